"""Plans on the wire (issue 24, item 5): what the ``plan`` requests of one node cost, as
URLs and as positions in a dataset told once, side by side.

At the start of every epoch each reader (a DataLoader worker of ``CachedDataset``) tells
the daemon its plan: the rest of this epoch's shards, then the next epoch's
(``cached_client.reader.announce``). It sends them in one of two forms:

- ``urls``: the URLs themselves, in the JSON header (what a client sends a daemon without
  the ``datasets`` feature, and what every client sent before it);
- ``compact``: each plan as base64 positions in the dataset's URL list, which goes to the
  daemon (a ``dataset`` request) only when it does not hold it yet (docs/protocol.md,
  "Datasets").

This script computes the plans of one node's readers with the client's own placement code
(``placement.plan``, ``resume.resume_spans``, as ``CachedDataset`` does for a fresh pass),
sends them with ``announce`` to a real ``cached serve`` (prefetch off, so its store is
never contacted), one connection per reader, in each form, and measures:

- the wire: the header frames of every plan request of the node per epoch, captured as the
  client's transport encodes them, per plan, per URL and per shard of the dataset, and
  the dataset's frames (once per node: the readers announce one after another here;
  readers that start at the same instant may each send it once);
- the daemon's CPU: the ``cached serve`` process's CPU over the node's announces, and,
  in this process, the steps the server runs per plan (decode; ``[server] allow`` check;
  URL checks, or positions resolved; position index; install in the planner), for a first
  install (epoch 0) and for the next epoch's plans, which replace them under the same keys;
- the daemon's memory: tracemalloc around holding the dataset once and installing all of
  the node's plans in a ``cached.planner.Planner``, per plan and per URL, with the
  ``cached serve`` RSS growth beside it.

    python bench/plan_wire.py            # 100,000 shards, 1 rank x 8 workers
    python bench/plan_wire.py --small    # 10,000 shards, a smoke run for CI
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import statistics
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cached_client import jobs, placement, resume
from cached_client.partition import Part
from cached_client.reader import announce
from cached_client.transport import Connection, connection
from cached_wire.catalog import Catalog
from cached_wire.protocol import Header, Op, decode, encode
from cached_wire.urls import check_all

from bench import common
from bench.bounds_rss import rss_mib, storeless_daemon
from cached.access import Access
from cached.datasets import Datasets, checked, resolve
from cached.planner import Planner, prepare
from cached.server.checks import MAX_REQUEST_DEPTH
from cached.server.plans import checked_plan
from cached_demo.stack import DaemonProcess

URL_TEMPLATE = "s3://training-data/imagenet/train/shard-{:06d}.tar"
SEED = 0
STEPS = ("decode", "allow", "urls", "index", "install")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shards", type=int, help="shards in the dataset (default 100000; --small 10000)"
    )
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    p.add_argument("--ranks", type=int, default=1, help="ranks per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the job (node 0 is measured)")
    p.add_argument("--placement", choices=placement.PLACEMENTS, default="global")
    p.add_argument("--url-template", default=URL_TEMPLATE, help="str.format of the shard index")
    p.add_argument("--repeats", type=int, help="epochs replacing the plans (default 3; --small 1)")
    p.add_argument(
        "--memory-epochs",
        type=int,
        help="epochs of plans installed under tracemalloc (default 20: the planner's index "
        "grows for some epochs before it settles; --small 4)",
    )
    p.add_argument("--small", action="store_true", help="a smoke run: 10,000 shards, once")
    p.add_argument("--out", type=Path, default=common.OUT_DIR, help="where the JSON goes")
    args = p.parse_args(argv)
    args.shards = args.shards or (10_000 if args.small else 100_000)
    args.repeats = args.repeats or (1 if args.small else 3)
    args.memory_epochs = args.memory_epochs or (4 if args.small else 20)
    return args


# -- the plans, as the client makes them -----------------------------------------------------


def node_readers(args: argparse.Namespace) -> list[placement.Reader]:
    """Node 0's readers, as ``CachedDataset.reader`` describes them in each worker."""
    local = args.ranks if args.placement == "node" else 1
    world = args.ranks * args.nodes
    return [
        placement.Reader(rank, world, worker, args.workers, args.placement, local)
        for rank in range(args.ranks)
        for worker in range(args.workers)
    ]


def node_plans(
    urls: Sequence[str], readers: Sequence[placement.Reader], epochs: range
) -> Iterator[list[list[str]]]:
    """Per epoch, what each reader announces at the start of a fresh pass (as
    ``CachedDataset``'s ``_Pass.stream``): its spans' URLs, then the shards it reads in the
    next epoch. Each epoch's parts are computed once and not kept."""

    def parts(epoch: int) -> list[list[Part]]:
        return [placement.plan(len(urls), r, shuffle=True, seed=SEED, epoch=epoch) for r in readers]

    now = parts(epochs.start)
    for epoch in epochs:
        ahead = parts(epoch + 1)
        yield [
            [s.url for s in resume.resume_spans(urls, mine, resume.Position(epoch))[0]]
            + [urls[p.shard] for p in next_epoch]
            for mine, next_epoch in zip(now, ahead, strict=True)
        ]
        now = ahead


@contextlib.contextmanager
def plan_frames() -> Iterator[tuple[list[bytes], list[bytes]]]:
    """The header frames of the ``plan`` and of the ``dataset`` requests sent meanwhile,
    as the transport encodes them (with the ``id`` it adds): the bytes on the socket."""
    plans: list[bytes] = []
    told: list[bytes] = []

    def encoding(header: Header) -> bytes:
        frame = encode(header)
        if header.get("op") == Op.PLAN:
            plans.append(frame)
        elif header.get("op") == Op.DATASET:
            told.append(frame)
        return frame

    with mock.patch.object(connection, "encode", encoding):
        yield plans, told


@dataclass
class Form:
    """One way of sending plans: ``"urls"`` (each plan its URLs, as before datasets, and
    as a client sends them to a daemon without the feature) or ``"compact"`` (the URL list
    told once per connection, plans as positions in it)."""

    name: str
    catalog: Catalog | None
    frames: list[list[bytes]] = field(default_factory=list)  # plan frames per epoch
    told: list[bytes] = field(default_factory=list)  # dataset frames (once per connection)
    epochs: list[dict[str, Any]] = field(default_factory=list)

    def frame(self, sent: bytes, plan: list[str]) -> bytes:
        """``sent`` (a plan frame of this form) for ``plan``'s URLs instead."""
        header = decode(sent)
        if self.catalog is None:
            return encode({**header, "urls": plan})
        return encode({**header, "index": self.catalog.index(plan)})


def later(form: Form, readers: list[placement.Reader], urls: list[str], epochs: int) -> None:
    """Extend ``form.frames`` up to ``epochs`` epochs with each reader's last frame made
    for the later epoch's plan: what its announces would send then."""
    last = form.frames[-1]
    for plans in node_plans(urls, readers, range(len(form.frames), epochs)):
        form.frames.append(
            [form.frame(frame, plan) for frame, plan in zip(last, plans, strict=True)]
        )


# -- the daemon: cached serve ----------------------------------------------------------------


def on_the_daemon(
    args: argparse.Namespace,
    readers: list[placement.Reader],
    urls: list[str],
    form: Form,
    tmp: Path,
) -> None:
    """Announce every reader's plan for epochs ``0..repeats`` to a ``cached serve``, in
    ``form``; per epoch, the frames sent and what the daemon spent (into ``form``)."""
    config, socket = storeless_daemon(tmp)
    key, job = uuid.uuid4().hex[:12], jobs.job_name()
    with DaemonProcess(config, socket) as daemon, contextlib.ExitStack() as stack:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        conns = [stack.enter_context(contextlib.closing(Connection(socket))) for _ in readers]
        for conn in conns:  # a worker's hello comes before its plan
            conn.open()
        time.sleep(1)
        rss_idle = rss_mib(pid)
        for epoch, plans in enumerate(node_plans(urls, readers, range(args.repeats + 1))):
            walls: list[float] = []
            cpu = sum(common.process_cpu(pid))
            with plan_frames() as (sent, told):
                for reader, conn, plan in zip(readers, conns, plans, strict=True):
                    started = time.perf_counter()
                    name = f"{key}/r{reader.rank}/s{reader.stream}"
                    if not announce(conn, name, plan, job, form.catalog):
                        raise RuntimeError("the daemon does not take plans")
                    walls.append(time.perf_counter() - started)
            cpu = sum(common.process_cpu(pid)) - cpu
            form.frames.append(sent)
            form.told += told
            form.epochs.append(
                {
                    "epoch": epoch,
                    "urls": sum(map(len, plans)),
                    "frame_bytes": sum(map(len, sent)),
                    "dataset_bytes": sum(map(len, told)),
                    "daemon_cpu_s": cpu,
                    "announce_wall_s": walls,
                    "daemon_rss_growth_bytes": int((rss_mib(pid) - rss_idle) * (1 << 20)),
                }
            )


# -- the daemon's steps, in this process -----------------------------------------------------


async def _install(
    planner: Planner, access: Access, held: Datasets, frames: list[bytes]
) -> dict[str, float]:
    """The server's steps for each request (``Dispatch.handle``, ``_check_access``,
    ``Plans.dataset`` or ``Plans.plan``), in order; the CPU seconds of each, summed over ``frames``.
    A dataset's steps count as "urls"; a plan by positions has no "allow" step (its
    dataset's URLs were allowed when told) and its "urls" step resolves the positions."""
    spent = dict.fromkeys(STEPS, 0.0)
    for frame in frames:
        t0 = time.process_time()
        header = decode(frame, max_depth=MAX_REQUEST_DEPTH)
        t1 = time.process_time()
        if "urls" in header:
            await access.check(header["urls"])
        t2 = time.process_time()
        if header["op"] == Op.DATASET:
            held.add(checked(header["dataset"], header["urls"]))
            spent["decode"] += t1 - t0
            spent["allow"] += t2 - t1
            spent["urls"] += time.process_time() - t2
            continue
        dataset = header.get("dataset", "")
        if dataset:  # cached.server.plans.Plans.plan, a plan by positions
            urls = resolve(held.get(dataset), header["index"], 1 << 30)
        else:  # cached.server.plans.checked_plan, in its two steps
            urls = header["urls"]
            if not all(isinstance(u, str) for u in urls):
                raise RuntimeError("a plan of non-strings")
            check_all(urls)
        t3 = time.process_time()
        plan = prepare(
            header["plan"], urls, cursor=header["cursor"], job=header["job"], dataset=dataset
        )
        t4 = time.process_time()
        for _ in planner.install(plan):
            pass
        t5 = time.process_time()
        for step, took in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            spent[step] += took
    return spent


def cpu_in_process(form: Form) -> list[dict[str, float]]:
    """Per epoch after the first, the steps' CPU for a first install of the node's plans
    then for their replacement by the next epoch's; the replacement's median round. The
    datasets are told before each round and not counted."""
    rounds = []
    for later_frames in form.frames[1:]:
        gc.collect()  # what an earlier round left is not this round's collection to do
        planner, access, held = Planner(), Access(), Datasets(math.inf)
        asyncio.run(_install(planner, access, held, form.told[:1]))
        first = asyncio.run(_install(planner, access, held, form.frames[0]))
        replace = asyncio.run(_install(planner, access, held, later_frames))
        rounds.append((sum(replace.values()), first, replace))
    _, first, replace = sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]
    return [first, replace]


def memory(form: Form) -> dict[str, Any]:
    """tracemalloc around the daemon's copy of the dataset (told once: every connection
    tells the same list, which the daemon holds once) and its install of the node's
    plans, as the server decodes, checks and installs them, then of each later epoch's
    replacing them: what stays after each epoch, and the peak over the start of each
    install. The request frames are not counted (the server frees them once a plan is
    installed)."""
    gc.collect()
    tracemalloc.start()
    try:
        planner, held = Planner(), Datasets(math.inf)
        for frame in form.told[:1]:
            header = decode(frame, max_depth=MAX_REQUEST_DEPTH)
            held.add(checked(header["dataset"], header["urls"]))
            del header
        gc.collect()
        dataset_bytes = tracemalloc.get_traced_memory()[0]
        retained: list[int] = []
        peaks: list[int] = []
        for epoch in form.frames:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            for frame in epoch:
                header = decode(frame, max_depth=MAX_REQUEST_DEPTH)
                if "dataset" in header:
                    urls = resolve(held.get(header["dataset"]), header["index"], 1 << 30)
                    plan = prepare(header["plan"], urls, cursor=header["cursor"], job=header["job"])
                else:
                    plan = checked_plan(
                        header["plan"], header["urls"], header["cursor"], header["job"]
                    )
                for _ in planner.install(plan):
                    pass
                del header, plan
            gc.collect()
            current, peak = tracemalloc.get_traced_memory()
            retained.append(current - dataset_bytes)
            peaks.append(peak - base)
        live = planner.plans()
        return {
            "dataset_bytes": dataset_bytes,
            "retained_bytes_by_epoch": retained,
            "peak_over_start_bytes_by_epoch": peaks,
            "plans": len(live),
            "urls": sum(len(p.urls) for p in live),
            "distinct_urls": len({u for p in live for u in p.urls}),
        }
    finally:
        tracemalloc.stop()


# -- the report ------------------------------------------------------------------------------


def summary(
    form: Form, plans: int, steps: list[dict[str, float]], mem: dict[str, Any]
) -> dict[str, Any]:
    """One form's figures, per node and epoch (medians over the epochs after the first)."""
    steady = form.epochs[1:]
    wire = statistics.median(e["frame_bytes"] for e in steady)
    held = mem["retained_bytes_by_epoch"][-1]
    return {
        "urls_per_epoch": statistics.median(e["urls"] for e in steady),
        "bytes_per_epoch": wire,
        "bytes_per_plan": [len(f) for f in form.frames[1]],
        "dataset_bytes_per_node": sum(map(len, form.told)),
        "dataset_tells": len(form.told),
        "cpu_s_per_plan": {
            "first": {step: steps[0][step] / plans for step in STEPS},
            "replace": {step: steps[1][step] / plans for step in STEPS},
            "cached_serve_first": form.epochs[0]["daemon_cpu_s"] / plans,
            "cached_serve_replace": statistics.median(e["daemon_cpu_s"] for e in steady) / plans,
        },
        "announce_wall_s": {
            "first": statistics.median(form.epochs[0]["announce_wall_s"]),
            "replace": statistics.median(w for e in steady for w in e["announce_wall_s"]),
        },
        "memory": {
            **mem,
            "retained_bytes_per_plan": held / plans,
            "retained_bytes_per_url": held / mem["urls"],
            "cached_serve_rss_growth_bytes": steady[-1]["daemon_rss_growth_bytes"],
        },
        "epochs": form.epochs,
    }


def _row(label: str, values: Sequence[str]) -> None:
    common.log(f"  {label:<34}" + "".join(f"{v:>18}" for v in values))


def report(
    args: argparse.Namespace, readers: list[placement.Reader], forms: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    plans = len(readers)
    figures = list(forms.values())
    n_urls = figures[0]["urls_per_epoch"]
    common.log(
        f"\none node's plans per epoch: {plans} readers ({args.ranks} rank(s) x {args.workers} "
        f"workers; node 0 of {args.nodes}, placement={args.placement!r}), {args.shards:,} shards, "
        f"{n_urls:,.0f} URLs per epoch ({n_urls / plans:,.0f} per plan)"
    )
    _row("", list(forms))
    _row("bytes per epoch", [common.human(f["bytes_per_epoch"]) for f in figures])
    _row("  per URL", [f"{f['bytes_per_epoch'] / n_urls:.1f} B" for f in figures])
    _row(
        "  per shard of the dataset",
        [f"{f['bytes_per_epoch'] / args.shards:.1f} B" for f in figures],
    )
    _row(
        "bytes per plan",
        [
            f"{common.human(min(f['bytes_per_plan']))}-{common.human(max(f['bytes_per_plan']))}"
            for f in figures
        ],
    )
    _row(
        "the dataset's list, once per node",
        [f"{common.human(f['dataset_bytes_per_node'])} ({f['dataset_tells']}x)" for f in figures],
    )
    for when in ("first", "replace"):
        _row(f"daemon CPU per plan, {when} (ms)", [""] * len(figures))
        for step in STEPS:
            _row(f"    {step}", [f"{f['cpu_s_per_plan'][when][step] * 1000:.2f}" for f in figures])
        _row(
            "    cached serve process",
            [f"{f['cpu_s_per_plan'][f'cached_serve_{when}'] * 1000:.1f}" for f in figures],
        )
        _row(
            "    announce round trip (wall)",
            [f"{f['announce_wall_s'][when] * 1000:.1f}" for f in figures],
        )
    _row(
        "daemon memory: the dataset, once",
        [common.human(f["memory"]["dataset_bytes"]) for f in figures],
    )
    for e in sorted({0, 1, len(figures[0]["memory"]["retained_bytes_by_epoch"]) - 1}):
        _row(
            f"  plans held after epoch {e}",
            [common.human(f["memory"]["retained_bytes_by_epoch"][e]) for f in figures],
        )
    _row("  per plan", [common.human(f["memory"]["retained_bytes_per_plan"]) for f in figures])
    _row("  per planned URL", [f"{f['memory']['retained_bytes_per_url']:.0f} B" for f in figures])
    _row(
        "  peak while replacing",
        [common.human(max(f["memory"]["peak_over_start_bytes_by_epoch"][1:])) for f in figures],
    )
    _row(
        "  cached serve RSS growth",
        [common.human(f["memory"]["cached_serve_rss_growth_bytes"]) for f in figures],
    )
    ratio = figures[0]["bytes_per_epoch"] / figures[-1]["bytes_per_epoch"]
    common.log(f"\n  the wire per epoch: {ratio:.1f}x less as positions")
    return {
        "config": {
            "shards": args.shards,
            "workers": args.workers,
            "ranks": args.ranks,
            "nodes": args.nodes,
            "placement": args.placement,
            "url_template": args.url_template,
            "repeats": args.repeats,
            "memory_epochs": args.memory_epochs,
        },
        "forms": forms,
        "wire_ratio": ratio,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    doc, started = common.start_run("plan_wire", "plans on the wire (issue 24, item 5)")
    urls = [args.url_template.format(i) for i in range(args.shards)]
    readers = node_readers(args)
    forms: dict[str, dict[str, Any]] = {}
    for form in (Form("urls", None), Form("compact", Catalog(urls))):
        common.log(
            f"{form.name}: announcing {len(readers)} plans per epoch to cached serve, "
            f"{args.repeats + 1} epochs"
        )
        with tempfile.TemporaryDirectory(prefix="plan-wire-") as tmp:
            on_the_daemon(args, readers, urls, form, Path(tmp))
        common.log(f"{form.name}: the server's steps in this process")
        steps = cpu_in_process(form)
        epochs = max(len(form.frames), args.memory_epochs)
        common.log(f"{form.name}: installing {epochs} epochs of plans under tracemalloc")
        later(form, readers, urls, epochs)
        forms[form.name] = summary(form, len(readers), steps, memory(form))
    doc.update(report(args, readers, forms))
    common.finish_run("plan_wire", doc, started, args.out)


if __name__ == "__main__":
    main()
