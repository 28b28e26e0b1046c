"""The hot tier's accounting and eviction, where a mutation run (issue 21) found behaviour
that no fast test held: bytes reserved, written, published and given back, the capacity
as the disk has it, pins, eviction order, replaced versions, prefetch admission, reload.
A real directory, no store and no daemon; the disk's free space is made up (``Disk``)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from cached.errors import CacheFull
from cached.hot.checks import Checks
from cached.hot.tier import (
    SHARED_DIR_MODE,
    SHARED_FILE_MODE,
    HotTier,
    NotAdmitted,
    Shard,
    ShardState,
    reservation_bytes,
)
from cached.hot.verify import ALGORITHM
from cached.planner import Planner
from cached.policy import BeladyPolicy, EvictionPolicy, LRUPolicy
from cached.stores.base import ObjectInfo
from cached_demo.tars import make_tar

BODY = make_tar([(f"s{i}", {"bin": bytes([i]) * 1000}) for i in range(4)])
NEED = reservation_bytes(len(BODY))
BIG = 1 << 40


class Disk:
    """``os.statvfs`` of a made-up file system: ``free`` bytes available, ``total`` in all."""

    def __init__(self, free: int = BIG, total: int = 2 * BIG) -> None:
        self.free, self.total = free, total

    def __call__(self, _path: object) -> SimpleNamespace:
        return SimpleNamespace(f_blocks=self.total, f_frsize=1, f_bavail=self.free)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    fake = Disk()
    monkeypatch.setattr(os, "statvfs", fake)
    return fake


def info(name: str, version: str = "v1") -> ObjectInfo:
    return ObjectInfo(f"s3://b/{name}.tar", "e", len(BODY), version)


async def publish(hot: HotTier, sid: str, name: str | None = None, version: str = "v1") -> Shard:
    writer = await hot.reserve(sid, info(name or sid, version), wait_s=0)
    hot.check()
    await writer.write((BODY,))
    hot.check()
    return await writer.publish()


def listing(directory: Path, pattern: str = "*") -> list[str]:
    """The names in ``directory`` (a plain function: no blocking call in a coroutine)."""
    return sorted(p.name for p in directory.glob(pattern))


def fit(hot: HotTier, room: int) -> None:
    """Set the capacity to what the tier holds now and ``room`` bytes more."""
    hot.configured_bytes = hot.stats().used_bytes + room


def test_a_reservation_covers_the_shard_and_a_sidecar_margin() -> None:
    for size in (0, 1000, 10 << 20, 1 << 34):
        need = reservation_bytes(size)
        assert isinstance(need, int) and need >= size + size // 16 + 65536


async def test_bytes_are_accounted_from_reservation_to_publication_and_abort(
    tmp_path: Path, disk: Disk
) -> None:
    disk.free = 10**6
    hot = HotTier(tmp_path, 10**9, 1000, LRUPolicy())
    first = hot.stats()
    assert (first.shards, first.used_bytes, first.pinned, first.fetching) == (0, 0, 0, 0)
    assert first.capacity_bytes == 10**9 and first.unverified == 0
    # The disk's room: the tier's own bytes on it, plus the free space, less min_free.
    assert hot.look_at_disk() == 10**6 - 1000
    writer = await hot.reserve("a", info("a"), wait_s=0)
    hot.check()
    st = hot.stats()
    assert (st.used_bytes, st.fetching, st.shards) == (NEED, 1, 0)
    assert hot.look_at_disk() == 10**6 - 1000  # reserved, nothing on the disk yet
    await writer.write((BODY[:1000],))
    hot.check()
    assert writer.bytes_written == 1000
    assert hot.look_at_disk() == 10**6 - 1000 + 1000  # 1000 bytes of ours on the disk
    await writer.write((BODY[1000:],))
    hot.check()
    assert writer.bytes_written == len(BODY)
    assert hot.look_at_disk() == 10**6 - 1000 + len(BODY)
    shard = await writer.publish()
    hot.check()
    size = len(BODY) + (tmp_path / "a.idx").stat().st_size
    assert shard.reserved_bytes == size and shard.state is ShardState.READY
    assert (shard.version, shard.info) == ("v1", info("a"))
    st = hot.stats()
    assert (st.used_bytes, st.fetching, st.shards) == (size, 0, 1)
    assert hot.look_at_disk() == 10**6 - 1000 + size
    assert list(hot.policy.victims()) == ["a"]
    # Downloads given up give their reservations back, and leave no file.
    writer = await hot.reserve("b", info("b"), wait_s=0)
    hot.check()
    other = await hot.reserve("c", info("c"), wait_s=0)
    hot.check()
    assert hot.stats().used_bytes == size + 2 * NEED
    assert hot.look_at_disk() == 10**6 - 1000 + size  # neither has written yet
    await writer.write((BODY[:500],))
    hot.check()
    writer.abort()
    hot.check()
    other.abort()
    hot.check()
    st = hot.stats()
    assert (st.used_bytes, st.fetching, st.shards) == (size, 0, 1)
    assert hot.look_at_disk() == 10**6 - 1000 + size
    assert listing(tmp_path) == ["a.idx", "a.tar"]
    # Less free space than min_free: no room at all, not a negative one.
    disk.free = 0
    hot.min_free_bytes = 10**7
    assert hot.look_at_disk() == 0


async def test_a_reservation_that_exactly_fits_is_made(tmp_path: Path, disk: Disk) -> None:
    hot = HotTier(tmp_path, NEED, 0, LRUPolicy())
    writer = await hot.reserve("a", info("a"), wait_s=0)
    hot.check()
    with pytest.raises(CacheFull, match="1 being fetched"):
        await hot.reserve("b", info("b"), wait_s=0)
        hot.check()
    writer.abort()
    hot.check()
    # The file system's size bounds it too: exactly its size less min_free fits.
    disk.total = NEED + 100
    hot = HotTier(tmp_path, 10**9, 100, LRUPolicy())
    (await hot.reserve("a", info("a"), wait_s=0)).abort()
    hot.check()
    hot.min_free_bytes = 101
    with pytest.raises(CacheFull, match="on the file system"):
        await hot.reserve("a", info("a"), wait_s=0)
        hot.check()


async def test_a_reservation_waits_its_wait_s_for_a_pin_to_go(tmp_path: Path, disk: Disk) -> None:
    hot = HotTier(tmp_path, 10**9, 0, LRUPolicy())  # pin_wait_s: 30 s by default
    shard = await publish(hot, "a")
    hot.check()
    hot.pin(shard)
    hot.check()
    fit(hot, NEED - 1)
    # wait_s=0: at once, not after pin_wait_s.
    with pytest.raises(CacheFull):
        await asyncio.wait_for(hot.reserve("b", info("b"), wait_s=0), 5)

    async def unpin_soon() -> None:
        await asyncio.sleep(0.05)
        hot.unpin(shard)
        hot.check()

    task = asyncio.create_task(unpin_soon())
    started = asyncio.get_running_loop().time()
    writer = await asyncio.wait_for(hot.reserve("b", info("b"), wait_s=0.9), 5)
    # Woken by the unpin, not by its next look at the disk (DISK_LOOK_S, 1 s).
    assert asyncio.get_running_loop().time() - started < 0.8
    await task
    assert hot.get("a", access=False) is None  # evicted once its reader let go
    writer.abort()
    hot.check()


async def test_pins_count_and_their_bytes_are_accounted_once(tmp_path: Path, disk: Disk) -> None:
    hot = HotTier(tmp_path, 10**9, 0, LRUPolicy())
    a = await publish(hot, "a")
    hot.check()
    b = await publish(hot, "b", "a-longer-name")
    hot.check()
    assert a.reserved_bytes != b.reserved_bytes
    hot.pin(a)
    hot.check()
    hot.pin(a)
    hot.check()
    assert a.pins == 2 and hot.pinned_total == a.reserved_bytes == a.pinned_bytes
    assert hot.stats().pinned == 1
    hot.unpin(a)
    hot.check()
    assert a.pins == 1 and hot.pinned_total == a.reserved_bytes
    hot.pin(b)
    hot.check()
    assert hot.pinned_total == a.reserved_bytes + b.reserved_bytes
    assert hot.pinned_bytes(set()) == a.reserved_bytes + b.reserved_bytes
    assert hot.pinned_bytes({b.url}) == a.reserved_bytes
    hot.unpin(a)
    hot.check()
    assert a.pins == 0 and a.pinned_bytes == 0 and hot.pinned_total == b.reserved_bytes
    hot.unpin(a)  # one too many: no harm
    hot.check()
    assert a.pins == 0 and hot.pinned_total == b.reserved_bytes
    assert hot.stats().pinned == 1 and hot.pinned_bytes(set()) == b.reserved_bytes
    writer = await hot.reserve("c", info("c"), wait_s=0)
    hot.check()
    assert {s.shard_id for s in hot.resident()} == {"a", "b"}  # not the one in flight
    # A pinned shard is never evicted; the unpinned one goes.
    fit(hot, 0)
    writer.abort()
    hot.check()
    fit(hot, NEED - 1)
    (await hot.reserve("d", info("d"), wait_s=0)).abort()
    hot.check()
    assert hot.get("a", access=False) is None and hot.get("b", access=False) is b


async def test_eviction_follows_the_policy_and_a_look_is_not_a_use(
    tmp_path: Path, disk: Disk
) -> None:
    evicted: list[str] = []
    hot = HotTier(tmp_path, 10**9, 0, LRUPolicy(), on_evict=lambda s: evicted.append(s.shard_id))
    for sid in ("a", "b", "c"):
        await publish(hot, sid)
        hot.check()
    assert hot.get("a") is not None  # a use: a is the newest now
    fit(hot, NEED - 1)
    await publish(hot, "d")
    hot.check()
    assert evicted == ["b"]
    assert hot.get("c", access=False) is not None  # a look: c stays the oldest
    fit(hot, NEED - 1)
    await publish(hot, "e")
    hot.check()
    assert evicted == ["b", "c"]
    assert hot.latest("s3://b/b.tar") is None and hot.latest("s3://b/a.tar") is not None
    assert sorted(hot.policy.victims()) == ["a", "d", "e"]
    assert not (tmp_path / "b.idx").exists() and not (tmp_path / "c.idx").exists()
    held = sum(s.reserved_bytes for s in hot.resident())
    assert hot.stats().used_bytes == held


async def test_evicted_bytes_count_as_free_until_their_file_is_unlinked(
    tmp_path: Path, disk: Disk
) -> None:
    disk.free = 10**6
    hot = HotTier(tmp_path, 10**9, 0, LRUPolicy())
    a = await publish(hot, "a")
    hot.check()
    await publish(hot, "b")
    hot.check()
    await publish(hot, "c")
    hot.check()
    room = hot.look_at_disk()
    assert room < 10**9  # the disk's room, not the capacity
    # The disk was found full: evict so that the download fits twice over.
    fit(hot, 2 * NEED - a.reserved_bytes // 2)
    assert hot.disk_full(NEED) == a.reserved_bytes  # the oldest alone was enough
    assert hot.get("a", access=False) is None and hot.get("b", access=False) is not None
    # Until the worker thread has unlinked it, its bytes are still on the disk.
    hot.configured_bytes = 10**9
    assert hot.look_at_disk() == room
    for _ in range(200):
        if not (tmp_path / "a.tar.evicted").exists() and hot._unlinking == 0:
            break
        await asyncio.sleep(0.01)
    assert hot._unlinking == 0 and listing(tmp_path, "*.evicted") == []
    assert hot.disk_full(NEED) == 0  # room enough: nothing evicted


async def test_a_new_version_replaces_the_old_one_unless_a_reader_holds_it(
    tmp_path: Path, disk: Disk
) -> None:
    evicted: list[str] = []
    hot = HotTier(tmp_path, 10**9, 0, LRUPolicy(), on_evict=lambda s: evicted.append(s.shard_id))
    old = await publish(hot, "old", "u", "v1")
    hot.check()
    new = await publish(hot, "new", "u", "v2")
    hot.check()
    assert evicted == ["old"] and hot.latest("s3://b/u.tar") is new
    assert hot.stats().used_bytes == new.reserved_bytes
    assert not (tmp_path / "old.tar").exists()
    # A held version stays (its reader goes on with it); new opens get the newest.
    hot.pin(new)
    hot.check()
    newer = await publish(hot, "newer", "u", "v3")
    hot.check()
    assert hot.get("new", access=False) is new and hot.latest("s3://b/u.tar") is newer
    hot.unpin(new)
    hot.check()
    assert old.state is ShardState.READY  # untouched, only forgotten
    # An unrelated URL is no replacement.
    await publish(hot, "other", "w", "v1")
    hot.check()
    assert evicted == ["old"]
    # Evicting the held version leaves the newest one current.
    fit(hot, NEED - 1)
    (await hot.reserve("next", info("next"), wait_s=0)).abort()
    hot.check()
    assert evicted == ["old", "new"] and hot.latest("s3://b/u.tar") is newer


def test_a_restart_reloads_shards_drops_leftovers_and_keeps_one_version(tmp_path: Path) -> None:
    async def fill() -> dict[str, Shard]:
        hot = HotTier(tmp_path, 10**9, 0, LRUPolicy())
        older = await publish(hot, "b-older", "u", "v1")
        hot.check()
        hot.pin(older)  # both versions stay on disk
        hot.check()
        newer = await publish(hot, "a-newer", "u", "v2")
        hot.check()
        other = await publish(hot, "c", "w", "v1")
        hot.check()
        return {"older": older, "newer": newer, "other": other}

    before = asyncio.run(fill())
    (tmp_path / "x.tar.partial").write_bytes(b"cut off")
    (tmp_path / "y.tar").write_bytes(b"no sidecar")
    (tmp_path / "0-garbage.idx").write_bytes(b"garbage")  # sorts first
    (tmp_path / "e.tar.evicted").write_bytes(b"left by a stop")
    hot = HotTier(tmp_path, 10**9, 0, LRUPolicy())
    # a-newer loads first: b-older, published before it, is the one dropped.
    assert hot.load() == 2
    assert listing(tmp_path) == ["a-newer.idx", "a-newer.tar", "c.idx", "c.tar"]
    newer = hot.latest("s3://b/u.tar")
    assert newer is not None and newer.shard_id == "a-newer"
    for name, shard in (("newer", newer), ("other", hot.get("c", access=False))):
        was = before[name]
        assert shard is not None and not shard.verified
        assert (shard.url, shard.version, shard.info) == (was.url, was.version, was.info)
        assert (shard.checksum, shard.published) == (was.checksum, was.published)
        assert shard.index == was.index and shard.index is not None
        assert shard.reserved_bytes == was.reserved_bytes
    st = hot.stats()
    assert st.shards == 2 and st.unverified == 2
    assert st.used_bytes == before["newer"].reserved_bytes + before["other"].reserved_bytes
    assert list(hot.policy.victims()) == ["a-newer", "c"]
    # The policy hears of each shard's URL: c, needed next, is not displaced.
    planner = Planner()
    planner.update("r", ["s3://b/w.tar", "s3://b/later.tar"])
    belady = BeladyPolicy(planner)
    HotTier(tmp_path, 10**9, 0, belady).load()
    assert not belady.admits("s3://b/later.tar", "c")
    # A smaller capacity after a restart: the oldest go until the rest fit.
    again = HotTier(tmp_path, before["other"].reserved_bytes, 0, LRUPolicy())
    assert again.load() == 1 and again.get("c", access=False) is not None


async def test_prefetch_evicts_only_what_is_needed_later_and_enough(
    tmp_path: Path, disk: Disk
) -> None:
    planner = Planner()
    planner.update("r", [f"s3://b/{n}.tar" for n in "ABCDEF"])
    policy: EvictionPolicy = BeladyPolicy(planner)
    hot = HotTier(tmp_path, 10**9, 0, policy)
    size = {n: (await publish(hot, n)).reserved_bytes for n in ("B", "E", "F", "Z")}
    # Z: no plan names it. Room after two evictions: Z and F (needed last); E is kept.
    fit(hot, NEED - size["Z"] - size["F"])
    (await hot.reserve("C", info("C"), prefetch=True)).abort()
    hot.check()
    assert {s.shard_id for s in hot.resident()} == {"B", "E"}
    # F comes after both: it may not take E's place, nor B's; nothing is evicted.
    fit(hot, NEED - 1)
    with pytest.raises(NotAdmitted):
        await hot.reserve("F", info("F"), prefetch=True)
        hot.check()
    assert {s.shard_id for s in hot.resident()} == {"B", "E"}
    # A (being read) may take both, but B is pinned and E alone is not enough.
    b = hot.get("B", access=False)
    assert b is not None
    hot.pin(b)
    hot.check()
    fit(hot, NEED - size["E"] - 1)
    with pytest.raises(NotAdmitted):
        await hot.reserve("A", info("A"), prefetch=True)
        hot.check()
    assert {s.shard_id for s in hot.resident()} == {"B", "E"}
    fit(hot, NEED - size["E"])  # E's room is enough now
    writer = await hot.reserve("A", info("A"), prefetch=True)
    hot.check()
    assert {s.shard_id for s in hot.resident()} == {"B"}
    assert writer.shard.info == info("A") and writer.shard.shard_id == "A"
    assert hot.get("A", access=False) is None and hot.stats().fetching == 1
    writer.abort()
    hot.check()


async def test_a_copy_fetched_again_after_corruption_starts_afresh(
    tmp_path: Path, disk: Disk
) -> None:
    hot = HotTier(tmp_path, 10**9, 0, LRUPolicy())
    found: list[tuple[Shard, str]] = []
    hot.on_corrupt(lambda shard, where: found.append((shard, where)))
    shard = await publish(hot, "a")
    hot.check()
    place = hot.locate(shard)
    st = (tmp_path / "a.tar").stat()
    assert place == {
        "path": str(tmp_path / "a.tar"),
        "ino": st.st_ino,
        "size": len(BODY),
        "mtime_ns": st.st_mtime_ns,
        "algorithm": ALGORITHM,
    }
    hot.pin(shard)
    hot.check()
    shard.verified = False  # as a shard reloaded at start
    hot.drop_corrupt(shard, "test", "check")
    hot.check()
    hot.drop_corrupt(shard, "test", "check")  # already gone: counted once
    hot.check()
    assert hot.corrupt_found == 1 and found == [(shard, "check")]
    assert hot.stats().used_bytes == 0
    writer = await hot.reserve("a", info("a", "v1"), wait_s=0)
    hot.check()
    assert writer.shard is shard and shard.pins == 1 and shard.generation == 1
    assert shard.state is ShardState.FETCHING and shard.verified
    assert (shard.index, shard.checksum, shard.location) == (None, None, None)
    assert shard.info == info("a")
    writer.abort()  # given up: the readers' copy is still theirs
    hot.check()
    writer = await hot.reserve("a", info("a", "v1"), wait_s=0)
    hot.check()
    assert writer.shard is shard and shard.generation == 2
    await writer.write((BODY,))
    hot.check()
    await writer.publish()
    hot.check()
    assert hot.locate(shard)["ino"] == (tmp_path / "a.tar").stat().st_ino
    assert hot.stats().used_bytes == shard.reserved_bytes
    hot.drop_corrupt(shard, "test", "read")
    hot.check()
    assert hot.corrupt_found == 2 and found[-1] == (shard, "read")
    hot.unpin(shard)  # the last reader let go: the next download is a new shard
    hot.check()
    writer = await hot.reserve("a", info("a", "v1"), wait_s=0)
    hot.check()
    assert writer.shard is not shard and writer.shard.generation == 0
    writer.abort()
    hot.check()


async def test_needs_check_and_locate_without_read_checks(tmp_path: Path, disk: Disk) -> None:
    hot = HotTier(tmp_path, 10**9, 0, LRUPolicy())
    checks = Checks(hot)
    shard = await publish(hot, "a")
    hot.check()
    assert not checks.needs_check(shard)
    shard.verified = False  # reloaded, not read back yet: every read checks its members
    assert not checks.needs_check(shard)
    assert shard.index is not None
    checked = shard.index
    shard.index = checked.without_checksums()  # an old sidecar's: nothing to check a read by
    assert checks.needs_check(shard)
    shard.index = checked
    hot.verify_reads = False
    assert checks.needs_check(shard)
    off = HotTier(tmp_path / "off", 10**9, 0, LRUPolicy(), verify_reads=False)
    off.load()
    assert off.locate(await publish(off, "b"))["algorithm"] is None


async def test_a_shared_tier_is_readable_by_the_group(tmp_path: Path, disk: Disk) -> None:
    where = tmp_path / "var" / "hot"  # its parent is made too
    private = HotTier(where, 10**9, 0, LRUPolicy())
    private.load()
    await publish(private, "a")
    mode("a.tar", where, 0o600)  # written while local reads were off
    hot = HotTier(where, 10**9, 0, LRUPolicy(), shared=True)
    hot.load()
    hot.check()
    await publish(hot, "b")
    hot.check()
    assert mode(".", where) == SHARED_DIR_MODE
    assert mode("a.tar", where) == mode("b.tar", where) == SHARED_FILE_MODE


def mode(name: str, directory: Path, new: int | None = None) -> int:
    """The permission bits of ``directory / name``, set to ``new`` first if given."""
    path = directory / name
    if new is not None:
        path.chmod(new)
    return stat.S_IMODE(path.stat().st_mode)
