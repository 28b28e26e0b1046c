"""Resume on another shape: a job's states, saved on N nodes (or ranks, or DataLoader
workers), merged into one state that a job of any shape resumes.

A reader's own state resumes only that reader (:func:`resume.check` refuses another rank,
world size or worker count): its position means something only in its own plan. But every
plan is arithmetic, so the states of *all* the readers of a job say exactly which samples
of the saved epoch nobody has read yet: each reader's parts from its position on, and the
samples in its shuffle buffer. :func:`elastic_state` gathers those positions into one
state; a reader of the new job that loads it computes the same rest of the epoch
(:func:`rest`) and takes its share of it (:func:`share`), so the rest is read exactly once
across the new readers. From the next epoch on, the new job follows its own plan
(with ``placement="node"``, its node count's ownership).

Use::

    states = [None] * world_size
    dist.all_gather_object(states, loader.state_dict())   # every rank's (or every
    torch.save(elastic_state(states), "loader.pt")          # StatefulDataLoader's) state
    # ... on the new job, any number of nodes and ranks:
    loader.load_state_dict(torch.load("loader.pt"))
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from . import resume
from .errors import UsageError
from .partition import Part
from .placement import Reader, epoch_owners, plan

LOADERS = ("CachedDataset", "FastLoader")
# What every reader of one job shares, and what a job that resumes must share with it.
JOB = ("loader", "shards", "urls", "shuffle", "seed", "equal_batches")
SHAPE = ("world_size", "workers", "placement", "local_world_size", "placement_mix")
_SHAPE_DEFAULTS: dict[str, Any] = {
    "workers": 1,
    "placement": "global",
    "local_world_size": None,
    "placement_mix": 0.0,
}


def elastic_state(states: Any) -> dict[str, Any]:
    """One state from the states of every reader of a job: a list of ranks' states
    (``FastLoader.state_dict()``, ``CachedDataset.state_dict()``, or torchdata
    ``StatefulDataLoader.state_dict()``, which holds each DataLoader worker's), in any
    nesting of lists and dicts. Load it with ``load_state_dict`` into a loader of the same
    shards, seed, shuffle and ``equal_batches`` on any number of nodes, ranks and workers.

    Raises :class:`UsageError` unless the states are those of one job, all of it: every
    reader (rank and worker) once, in one epoch."""
    found: dict[tuple[int, int], Mapping[str, Any]] = {}
    first: Mapping[str, Any] | None = None
    for state in _reader_states(states):
        if state.get("elastic"):
            raise UsageError(
                "cannot merge an elastic state with others: a reader that loaded it has not "
                "started yet (iterate it once), or the states were merged already"
            )
        if state.get("version") not in resume.READABLE_VERSIONS:
            raise UsageError(f"cannot merge a state of format version {state.get('version')!r}")
        first = first or state
        for key in JOB + SHAPE:
            mine, theirs = _get(first, key), _get(state, key)
            if mine != theirs:
                raise UsageError(
                    f"cannot merge states of different jobs: {key} {mine!r} and {theirs!r}"
                )
        who = (int(state["rank"]), int(state.get("worker", 0)))
        if who in found and found[who] != state:
            raise UsageError(f"two different states of rank {who[0]}, worker {who[1]}")
        found[who] = state
    if first is None:
        raise UsageError("no loader state among the states given to elastic_state")
    world, workers = int(first["world_size"]), int(_get(first, "workers"))
    missing = [(r, w) for r in range(world) for w in range(workers) if (r, w) not in found]
    if missing:
        shown = ", ".join(f"rank {r} worker {w}" for r, w in missing[:5])
        raise UsageError(
            f"cannot merge: {len(missing)} of the job's {world * workers} readers have no "
            f"state ({shown}{'...' if len(missing) > 5 else ''}); gather every rank's state"
        )
    epoch = max(int(s["epoch"]) for s in found.values())
    readers = []
    for (rank, worker), state in sorted(found.items()):
        if int(state["epoch"]) < epoch:
            if not resume.done(state):
                raise UsageError(
                    f"cannot merge: rank {rank} worker {worker} is part-way through epoch "
                    f"{state['epoch']}, others are in epoch {epoch}"
                )
            # It finished its epoch and has not begun this one: all of its share is left.
            state = {"part": 0, "offset": 0, "parts": None, "buffer": [], "own": None}
        readers.append(
            {
                "rank": rank,
                "worker": worker,
                "part": int(state["part"]),
                "offset": int(state["offset"]),
                "parts": state.get("parts"),
                "buffer": [[int(p), int(o)] for p, o in state.get("buffer") or []],
                "own": state.get("own"),
            }
        )
    lengths = {s.get("lengths") for s in found.values()} - {None}
    if len(lengths) > 1:
        raise UsageError("cannot merge: the readers saw different shard sample counts")
    return {
        **{key: _get(first, key) for key in JOB + SHAPE},
        "version": resume.STATE_VERSION,
        "elastic": True,
        "epoch": epoch,
        "lengths": lengths.pop() if lengths else None,
        "done": all(r["parts"] is not None and resume.done(r) for r in readers),
        "readers": readers,
    }


def check(state: Mapping[str, Any], identity: Mapping[str, Any]) -> None:
    """Raise :class:`UsageError` unless the elastic ``state`` may be resumed by the reader
    ``identity`` describes: the same loader kind, shards, seed, shuffle and equal_batches
    (the shape of the job may differ)."""
    diffs = [
        f"{key}: saved {state.get(key)!r}, here {identity[key]!r}"
        for key in JOB
        if state.get(key) != identity[key]
    ]
    if diffs:
        raise UsageError(
            f"cannot resume {identity['loader']} from this merged state: it was saved by "
            "another job (" + "; ".join(diffs) + ")"
        )
    if not isinstance(state.get("epoch"), int) or not isinstance(state.get("readers"), list):
        raise UsageError(f"cannot resume {identity['loader']}: a damaged merged state")


# I76: a resume on another world size reads the rest once.
def rest(
    state: Mapping[str, Any], n_shards: int, lengths: Sequence[int] | None = None
) -> list[Part]:
    """The samples of the saved epoch that no reader of the saved job has taken, as runs
    ``Part(shard, start, stop)``, in an order fixed by (seed, epoch). ``lengths`` (the
    shards' sample counts) are needed with ``equal_batches``: the saved plans split by them."""
    saved_lengths = state.get("lengths")
    if lengths is not None and saved_lengths not in (None, resume.fingerprint(lengths)):
        raise UsageError(
            "cannot resume: the shards' sample counts changed since the state was saved"
        )
    seed, epoch = state["seed"], state["epoch"]
    counts: Callable[[], Sequence[int]] | None = None
    if state["equal_batches"]:
        if lengths is None:
            raise UsageError("resuming an equal_batches state needs the shards' sample counts")
        counts = lambda: lengths  # noqa: E731
    runs: dict[int, list[tuple[int, int | None]]] = {}
    for saved in state["readers"]:
        reader = Reader(
            saved["rank"],
            state["world_size"],
            saved["worker"],
            state["workers"],
            state["placement"],
            state["local_world_size"] or 1,
            state["placement_mix"],
        )
        if saved.get("own") is not None:
            parts = parts_from(saved["own"])
        else:
            parts = plan(
                n_shards, reader, shuffle=state["shuffle"], seed=seed, epoch=epoch, lengths=counts
            )
        if saved["parts"] is not None and saved["parts"] != len(parts):
            raise UsageError(
                f"cannot resume: rank {reader.rank} worker {reader.worker} saved {saved['parts']} "
                f"parts of epoch {epoch}, its plan has {len(parts)} (did the shards change?)"
            )
        for part, offset in saved["buffer"]:
            if part >= len(parts):
                raise UsageError("cannot resume: a damaged shuffle buffer in a merged state")
            at = parts[part].start + offset
            runs.setdefault(parts[part].shard, []).append((at, at + 1))
        for k in range(saved["part"], len(parts)):
            p = parts[k]
            start = p.start + (saved["offset"] if k == saved["part"] else 0)
            if p.stop is None or start < p.stop:
                runs.setdefault(p.shard, []).append((start, p.stop))
    merged = [run for shard in sorted(runs) for run in _merge(shard, runs[shard])]
    if state["shuffle"]:
        random.Random(f"rest/{seed}/{epoch}").shuffle(merged)
    return merged


def _merge(shard: int, runs: list[tuple[int, int | None]]) -> Iterator[Part]:
    """``shard``'s runs, sorted, adjacent ones joined; overlapping ones are two readers'
    claims on one sample: the states are not of one job."""
    runs.sort()
    start, stop = runs[0]
    for a, b in runs[1:]:
        if stop is None or a < stop:
            raise UsageError(f"cannot resume: two readers' states overlap in shard {shard}")
        if a == stop:
            stop = b
            continue
        yield Part(shard, start, stop)
        start, stop = a, b
    yield Part(shard, start, stop)


def share(
    runs: Sequence[Part],
    reader: Reader,
    *,
    n_shards: int,
    seed: int,
    epoch: int,
    lengths: Sequence[int] | None = None,
) -> list[Part]:
    """``reader``'s share of the rest of an epoch. With ``lengths`` (``equal_batches``):
    the rest laid end to end and cut into equal contiguous runs over all the readers of the
    job (up to readers - 1 samples left out); else whole runs round-robin, with
    ``placement="node"`` over the readers of the node that owns each run's shard in the
    new job, so what a node reads now is what it caches from the next epoch on."""
    if lengths is not None:
        sized = [
            Part(r.shard, r.start, lengths[r.shard] if r.stop is None else r.stop) for r in runs
        ]
        each = sum(_size(r) for r in sized) // reader.streams
        return _cut(sized, reader.stream * each, (reader.stream + 1) * each)
    if reader.placement == "node":
        owner = epoch_owners(n_shards, reader.nodes, seed, epoch, mix=reader.mix)
        mine = [r for r in runs if owner[r.shard] == reader.node]
        return list(mine[reader.local_stream :: reader.local_streams])
    return list(runs[reader.stream :: reader.streams])


def resumed_share(
    saved: Mapping[str, Any],
    reader: Reader,
    *,
    n_shards: int,
    seed: int,
    epoch: int,
    lengths: Sequence[int] | None = None,
) -> list[Part]:
    """``reader``'s share of what no reader of the merged state ``saved`` had read
    (:func:`rest`, then :func:`share`): where a loader resumed elastically starts."""
    runs = rest(saved, n_shards, lengths)
    return share(runs, reader, n_shards=n_shards, seed=seed, epoch=epoch, lengths=lengths)


def _bounded(run: Part, lengths: Sequence[int]) -> Part:
    """``run`` with its end ("to the end of the shard") as a number."""
    return run if run.stop is not None else Part(run.shard, run.start, lengths[run.shard])


def _size(run: Part) -> int:
    assert run.stop is not None
    return run.stop - run.start


def _cut(runs: Sequence[Part], lo: int, hi: int) -> list[Part]:
    """Samples ``lo..hi`` of ``runs`` laid end to end."""
    out: list[Part] = []
    pos = 0
    for run in runs:
        n = _size(run)
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append(Part(run.shard, run.start + a - pos, run.start + b - pos))
        pos += n
        if pos >= hi:
            break
    return out


def parts_from(saved: Sequence[Sequence[Any]]) -> list[Part]:
    """Parts from a state's ``own`` list (``[shard, start, stop]`` each)."""
    try:
        return [Part(int(s), int(a), None if b is None else int(b)) for s, a, b in saved]
    except (TypeError, ValueError):
        raise UsageError("cannot resume: a damaged list of parts in the state") from None


def parts_state(parts: Sequence[Part]) -> list[list[int | None]]:
    """A reader's parts as plain lists, for its state (see :func:`parts_from`)."""
    return [[p.shard, p.start, p.stop] for p in parts]


def _get(state: Mapping[str, Any], key: str) -> Any:
    return state.get(key, _SHAPE_DEFAULTS.get(key))


def _reader_states(value: Any) -> Iterator[Mapping[str, Any]]:
    """Every loader state in ``value``, however nested in dicts and lists."""
    if isinstance(value, Mapping):
        if value.get("loader") in LOADERS and "epoch" in value:
            yield value
            return
        for item in value.values():
            yield from _reader_states(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _reader_states(item)
