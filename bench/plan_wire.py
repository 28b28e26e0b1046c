"""Plans on the wire (issue 24, item 5): what the ``plan`` requests of one node cost today.

At the start of every epoch each reader (a DataLoader worker of ``CachedDataset``) tells
the daemon its plan: the URLs of the rest of this epoch's shards, then those of the next
epoch's, in one JSON header (``cached_client.reader.announce``). This script computes the
plans of one node's readers with the client's own placement code (``placement.plan``,
``resume.resume_spans``, as ``CachedDataset`` does for a fresh pass), sends them with
``announce`` to a real ``cached serve`` (prefetch off, so its store is never contacted),
one connection per reader, and measures:

- the wire: the header frames of every plan request of the node per epoch, captured as the
  client's transport encodes them, per plan, per URL and per shard of the dataset;
- the daemon's CPU: the ``cached serve`` process's CPU over the node's announces, and,
  in this process, the steps the server runs per plan (decode; ``[server] allow`` check;
  URL checks and position index; install in the planner), for a first install (epoch 0)
  and for the next epoch's plans, which replace them under the same keys;
- the daemon's memory: tracemalloc around installing all of the node's plans in a
  ``cached.planner.Planner``, per plan and per URL, with the ``cached serve`` RSS growth
  beside it.

    python bench/plan_wire.py            # 100,000 shards, 1 rank x 8 workers
    python bench/plan_wire.py --small    # 10,000 shards, a smoke run for CI
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cached_client import jobs, placement, resume, transport
from cached_client.partition import Part
from cached_client.protocol import Header, Op, decode, encode, encode_value
from cached_client.reader import announce
from cached_client.transport import Connection
from cached_client.urls import check_all

from bench import common
from bench.bounds_rss import rss_mib, storeless_daemon
from cached.access import Access
from cached.demo.stack import DaemonProcess
from cached.planner import Planner, prepare
from cached.server import MAX_REQUEST_DEPTH, _checked_plan

URL_TEMPLATE = "s3://training-data/imagenet/train/shard-{:06d}.tar"
SEED = 0
STEPS = ("decode", "allow", "check_urls", "index", "install")


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
def plan_frames() -> Iterator[list[bytes]]:
    """The header frames of the plan requests sent meanwhile, as the transport encodes
    them (with the ``id`` it adds): the bytes that go on the socket."""
    sent: list[bytes] = []

    def encoding(header: Header) -> bytes:
        frame = encode(header)
        if header.get("op") == Op.PLAN:
            sent.append(frame)
        return frame

    with mock.patch.object(transport, "encode", encoding):
        yield sent


def later(
    frames: list[list[bytes]], readers: list[placement.Reader], urls: list[str], epochs: int
) -> list[list[bytes]]:
    """``frames`` and, up to ``epochs`` epochs, each reader's last frame again with the
    URLs of the later epoch: what its announces would send then."""
    out = list(frames)
    for plans in node_plans(urls, readers, range(len(frames), epochs)):
        out.append(
            [
                encode({**decode(frame), "urls": plan})
                for frame, plan in zip(frames[-1], plans, strict=True)
            ]
        )
    return out


# -- the daemon: cached serve ----------------------------------------------------------------


def on_the_daemon(
    args: argparse.Namespace, readers: list[placement.Reader], urls: list[str], tmp: Path
) -> tuple[list[list[bytes]], list[dict[str, Any]]]:
    """Announce every reader's plan for epochs ``0..repeats`` to a ``cached serve``; per
    epoch, the frames sent and what the daemon spent."""
    config, socket = storeless_daemon(tmp)
    key, job = uuid.uuid4().hex[:12], jobs.job_name()
    frames: list[list[bytes]] = []
    epochs: list[dict[str, Any]] = []
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
            with plan_frames() as sent:
                for reader, conn, plan in zip(readers, conns, plans, strict=True):
                    started = time.perf_counter()
                    if not announce(conn, f"{key}/r{reader.rank}/s{reader.stream}", plan, job):
                        raise RuntimeError("the daemon does not take plans")
                    walls.append(time.perf_counter() - started)
            cpu = sum(common.process_cpu(pid)) - cpu
            frames.append(sent)
            epochs.append(
                {
                    "epoch": epoch,
                    "urls": sum(map(len, plans)),
                    "frame_bytes": sum(map(len, sent)),
                    "daemon_cpu_s": cpu,
                    "announce_wall_s": walls,
                    "daemon_rss_growth_bytes": int((rss_mib(pid) - rss_idle) * (1 << 20)),
                }
            )
    return frames, epochs


# -- the daemon's steps, in this process -----------------------------------------------------


async def _install(planner: Planner, access: Access, frames: list[bytes]) -> dict[str, float]:
    """The server's steps for each plan request (``Server._handle``, ``_check_access``,
    ``_plan``), in order; the CPU seconds of each, summed over ``frames``."""
    spent = dict.fromkeys(STEPS, 0.0)
    for frame in frames:
        t0 = time.process_time()
        header = decode(frame, max_depth=MAX_REQUEST_DEPTH)
        t1 = time.process_time()
        await access.check(header["urls"])
        t2 = time.process_time()
        # cached.server._checked_plan, in its two steps.
        urls = header["urls"]
        if not all(isinstance(u, str) for u in urls):
            raise RuntimeError("a plan of non-strings")
        check_all(urls)
        t3 = time.process_time()
        plan = prepare(header["plan"], urls, cursor=header["cursor"], job=header["job"])
        t4 = time.process_time()
        for _ in planner.install(plan):
            pass
        t5 = time.process_time()
        for step, took in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            spent[step] += took
    return spent


def cpu_in_process(frames: list[list[bytes]]) -> list[dict[str, float]]:
    """Per epoch after the first, the steps' CPU for a first install of the node's plans
    then for their replacement by the next epoch's; the replacement's median round."""
    rounds = []
    for later in frames[1:]:
        gc.collect()  # what an earlier round left is not this round's collection to do
        planner, access = Planner(), Access()
        first = asyncio.run(_install(planner, access, frames[0]))
        replace = asyncio.run(_install(planner, access, later))
        rounds.append((sum(replace.values()), first, replace))
    _, first, replace = sorted(rounds, key=lambda r: r[0])[len(rounds) // 2]
    return [first, replace]


def memory(frames: list[list[bytes]]) -> dict[str, Any]:
    """tracemalloc around the planner's install of the node's plans, as the server decodes,
    checks and installs them, then of each later epoch's replacing them: what stays after
    each epoch, and the peak over the start of each install. The request frames are not
    counted (the server frees them once a plan is installed)."""
    gc.collect()
    tracemalloc.start()
    try:
        planner = Planner()
        retained: list[int] = []
        peaks: list[int] = []
        for epoch in frames:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            for frame in epoch:
                header = decode(frame, max_depth=MAX_REQUEST_DEPTH)
                plan = _checked_plan(
                    header["plan"], header["urls"], header["cursor"], header["job"]
                )
                for _ in planner.install(plan):
                    pass
                del header, plan
            gc.collect()
            current, peak = tracemalloc.get_traced_memory()
            retained.append(current)
            peaks.append(peak - base)
        live = planner.plans()
        return {
            "retained_bytes_by_epoch": retained,
            "peak_over_start_bytes_by_epoch": peaks,
            "plans": len(live),
            "urls": sum(len(p.urls) for p in live),
            "distinct_urls": len({u for p in live for u in p.urls}),
        }
    finally:
        tracemalloc.stop()


# -- the report ------------------------------------------------------------------------------


def _ms(seconds: float, plans: int) -> str:
    return f"{seconds / plans * 1000:9.1f}"


def report(
    args: argparse.Namespace,
    readers: list[placement.Reader],
    urls: list[str],
    *,
    frames: list[list[bytes]],
    epochs: list[dict[str, Any]],
    steps: list[dict[str, float]],
    mem: dict[str, Any],
) -> dict[str, Any]:
    plans = len(readers)
    steady = epochs[1:]
    wire_bytes = statistics.median(e["frame_bytes"] for e in steady)
    n_urls = statistics.median(e["urls"] for e in steady)
    once = len(encode_value(urls))
    per_plan = [len(f) for f in frames[1]]
    common.log(
        f"\none node's plans per epoch: {plans} readers ({args.ranks} rank(s) x {args.workers} "
        f"workers; node 0 of {args.nodes}, placement={args.placement!r}), {args.shards:,} shards"
    )
    common.log(f"  URLs per epoch       {n_urls:,.0f} ({n_urls / plans:,.0f} per plan)")
    common.log(
        f"  bytes per plan       {common.human(min(per_plan))} - {common.human(max(per_plan))}"
    )
    common.log(
        f"  bytes per epoch      {wire_bytes:,.0f} ({common.human(wire_bytes)}): "
        f"{wire_bytes / n_urls:.1f} B per URL, {wire_bytes / args.shards:.1f} B per shard"
    )
    common.log(f"  the URL list once    {once:,} ({common.human(once)})")
    common.log(f"\nthe daemon's CPU per plan (ms)  {'first':>9} {'replace':>9}")
    for step in STEPS:
        common.log(f"  {step:<30}{_ms(steps[0][step], plans)} {_ms(steps[1][step], plans)}")
    totals = [sum(s.values()) for s in steps]
    common.log(f"  {'in-process total':<30}{_ms(totals[0], plans)} {_ms(totals[1], plans)}")
    serve_cpu = [epochs[0]["daemon_cpu_s"], statistics.median(e["daemon_cpu_s"] for e in steady)]
    common.log(
        f"  {'cached serve process CPU':<30}{_ms(serve_cpu[0], plans)} {_ms(serve_cpu[1], plans)}"
    )
    walls = [
        statistics.median(epochs[0]["announce_wall_s"]),
        statistics.median(w for e in steady for w in e["announce_wall_s"]),
    ]
    common.log(f"  {'announce round trip (wall)':<30}{_ms(walls[0], 1)} {_ms(walls[1], 1)}")
    held = mem["retained_bytes_by_epoch"][-1]
    common.log(
        f"\nthe daemon's memory for the node's plans ({mem['plans']} plans, {mem['urls']:,} URLs, "
        f"{mem['distinct_urls']:,} distinct)"
    )
    by_epoch = mem["retained_bytes_by_epoch"]
    shown = sorted({0, 1, len(by_epoch) - 1})
    common.log(
        "  retained after epoch   " + ", ".join(f"{e}: {common.human(by_epoch[e])}" for e in shown)
    )
    common.log(
        f"  retained at the end    {common.human(held)}: {common.human(held / plans)} per plan, "
        f"{held / mem['urls']:.0f} B per URL"
    )
    peaks = mem["peak_over_start_bytes_by_epoch"]
    common.log(
        f"  peak while installing   first {common.human(peaks[0])}, "
        f"replacing {common.human(max(peaks[1:]))} over what was held"
    )
    rss = steady[-1]["daemon_rss_growth_bytes"]
    common.log(f"  cached serve RSS growth {common.human(rss)} ({rss / n_urls:.0f} B per URL)")
    return {
        "config": {
            "shards": args.shards,
            "workers": args.workers,
            "ranks": args.ranks,
            "nodes": args.nodes,
            "placement": args.placement,
            "url_template": args.url_template,
            "repeats": args.repeats,
            "memory_epochs": len(mem["retained_bytes_by_epoch"]),
        },
        "wire": {
            "plans_per_epoch": plans,
            "urls_per_epoch": n_urls,
            "bytes_per_epoch": wire_bytes,
            "bytes_per_plan": per_plan,
            "bytes_per_url": wire_bytes / n_urls,
            "bytes_per_shard": wire_bytes / args.shards,
            "url_list_once_bytes": once,
        },
        "daemon_cpu_s_per_plan": {
            "first": {step: steps[0][step] / plans for step in STEPS},
            "replace": {step: steps[1][step] / plans for step in STEPS},
            "cached_serve_first": serve_cpu[0] / plans,
            "cached_serve_replace": serve_cpu[1] / plans,
            "announce_wall_first": walls[0],
            "announce_wall_replace": walls[1],
        },
        "daemon_memory": {
            **mem,
            "retained_bytes_per_plan": held / plans,
            "retained_bytes_per_url": held / mem["urls"],
            "cached_serve_rss_growth_bytes": rss,
        },
        "epochs": epochs,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    doc, started = common.start_run("plan_wire", "plans on the wire (issue 24, item 5)")
    urls = [args.url_template.format(i) for i in range(args.shards)]
    readers = node_readers(args)
    common.log(
        f"announcing {len(readers)} plans per epoch to cached serve, {args.repeats + 1} epochs"
    )
    with tempfile.TemporaryDirectory(prefix="plan-wire-") as tmp:
        frames, epochs = on_the_daemon(args, readers, urls, Path(tmp))
    common.log("the server's steps in this process")
    steps = cpu_in_process(frames)
    common.log(
        f"installing {max(len(frames), args.memory_epochs)} epochs of plans under tracemalloc"
    )
    mem = memory(later(frames, readers, urls, max(len(frames), args.memory_epochs)))
    doc.update(report(args, readers, urls, frames=frames, epochs=epochs, steps=steps, mem=mem))
    common.finish_run("plan_wire", doc, started, args.out)


if __name__ == "__main__":
    main()
