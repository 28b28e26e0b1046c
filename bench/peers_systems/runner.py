"""One system's run of ``bench/peers.py``, in a process of its own:

    python -m bench.peers_systems.runner '<Spec as JSON>'

``mode`` "prepare" runs the system's conversion and reports its seconds; "epochs" opens the
system's loader and runs ``epochs`` epochs, reporting each. Messages to the driver are lines
``@@<kind> <json>`` on stdout (other output is passed through); the link's byte counter is
asked for on stdout and answered on stdin (``base.link_mark``).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from bench.peers_systems import BY_NAME, base


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    spec = base.Spec.from_json(args[0])
    Path(spec.workdir).mkdir(parents=True, exist_ok=True)
    info = BY_NAME[spec.system]
    peer: base.Peer | None = None
    try:
        module = importlib.import_module(f"bench.peers_systems.{info.module}")
        peer = getattr(module, info.cls)(spec)
        assert peer is not None
        if spec.mode == "prepare":
            base.emit("prepared", {"conversion_s": peer.prepare()})
            return 0
        started = time.perf_counter()
        peer.open()
        base.emit("opened", {"open_s": time.perf_counter() - started})
        for epoch in range(spec.epochs):
            record = peer.run_epoch(epoch)
            base.emit("epoch", dataclasses.asdict(record))
        return 0
    except Exception as exc:
        detail = traceback.format_exc()[-3000:]
        if peer is not None:
            detail += peer.failure_detail()
        base.emit("error", {"error": f"{type(exc).__name__}: {exc}"[:2000], "detail": detail})
        return 1
    finally:
        if peer is not None:
            peer.close()


if __name__ == "__main__":
    sys.exit(main())
