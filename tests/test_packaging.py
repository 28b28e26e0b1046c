"""What the two packages install and import: the daemon never needs torch.

``pip install cached-daemon`` brings cached-client for the wire protocol, without torch
(an extra of cached-client's); deploy/check/systemd.sh installs the daemon into a fresh
environment for real and checks ``pip check`` and that torch is absent. Here: the daemon's
modules import and serve with torch unimportable, and the client says what to install when
a torch part is asked for without it.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# torch made unimportable in a fresh interpreter, as in an environment without it: a finder
# ahead of the others answers as the import system does for a module it cannot find.
NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_torch_is_an_extra_of_the_client_and_the_daemon_does_not_ask_for_it() -> None:
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    daemon = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in client["dependencies"] if d.startswith("torch")]
    assert client["optional-dependencies"]["torch"] == ["torch>=2.1"]
    assert [d for d in daemon["dependencies"] if d.startswith("cached-client")] == [
        "cached-client==0.1.0"
    ]


def test_the_daemon_imports_and_parses_its_config_without_torch() -> None:
    done = run(
        "import cached.daemon, cached.server, cached.cli, cached.fetcher\n"
        "from cached.config import load\n"
        "from cached_client import CachedClientError, protocol, urls, transport, reader\n"
        "load(None, env={})\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_torch_part_of_the_client_without_torch_says_what_to_install() -> None:
    done = run("from cached_client import CachedDataset")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: cached_client.CachedDataset needs torch"), last
    assert "pip install 'cached-client[torch]'" in last
