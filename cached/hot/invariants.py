"""The hot tier's invariants, asserted: :func:`check` walks a :class:`.hot.HotTier`
(its :class:`.room.Room` part) and raises AssertionError naming the first invariant that does not
hold, by its number in docs/architecture.md, section 5 (as SQLite's
``assert_pager_state()`` asserts its pager's). The tests call it after each state change
they drive; the daemon never does (it walks every shard and stats their files).

Explicit ``raise``, not ``assert``: the check holds under ``python -O`` too.
"""

from __future__ import annotations

from .room import Room
from .shard import Shard, ShardState


def _fail(number: str, claim: str, found: str) -> AssertionError:
    return AssertionError(f"hot tier invariant {number} ({claim}) broken: {found}")


def check(tier: Room) -> None:
    """Raise AssertionError if one of the tier's invariants does not hold now; return
    None otherwise. Call it on the event loop thread, between two state changes."""
    shards = tier._shards
    for key, shard in shards.items():
        if key != shard.shard_id or shard.state not in (ShardState.FETCHING, ShardState.READY):
            raise _fail(
                "I2", "one entry per shard id", f"{key!r} holds {shard.shard_id!r} {shard.state}"
            )
    _check_bytes(tier, list(shards.values()))
    _check_pins(tier)
    _check_states(tier)


def _check_bytes(tier: Room, shards: list[Shard]) -> None:
    """I1 to I4: the bytes the tier counts."""
    reserved = sum(s.reserved_bytes for s in shards)
    if tier._used != reserved:
        raise _fail(
            "I2",
            "used bytes are the sum of the shards' reservations",
            f"used {tier._used}, the shards reserve {reserved}",
        )
    if tier._used > tier.configured_bytes:
        raise _fail(
            "I1",
            "the tier's bytes never pass [cache] capacity",
            f"used {tier._used} of {tier.configured_bytes}",
        )
    writing = sum(
        s.reserved_bytes
        for s in (*shards, *tier._orphans.values())
        if s.state is ShardState.FETCHING
    )
    if not 0 <= tier._unwritten <= writing:
        raise _fail(
            "I3",
            "unwritten bytes are part of the downloads' reservations",
            f"unwritten {tier._unwritten}, downloads under way reserve {writing}",
        )
    if tier._unlinking < 0:
        raise _fail("I4", "evicted bytes being unlinked", f"{tier._unlinking} bytes")


def _check_pins(tier: Room) -> None:
    """I8, I10 to I12: pins, waits and orphans."""
    held = [*tier._shards.values(), *tier._orphans.values()]
    for shard in held:
        if (shard.pins > 0) != (shard.pinned_bytes > 0) or shard.pins < 0:
            raise _fail(
                "I10",
                "a pinned shard counts its bytes, an unpinned one none",
                f"{shard.shard_id}: {shard.pins} pins, {shard.pinned_bytes} bytes counted",
            )
    pinned = sum(s.pinned_bytes for s in held if s.pins)
    if tier._pinned_total != pinned:
        # A pinned shard evicted (not orphaned) leaves its bytes in the total: I8 too.
        raise _fail(
            "I10",
            "the pinned total is the pinned shards' bytes, once each (I8: none evicted)",
            f"total {tier._pinned_total}, the pinned shards held count {pinned}",
        )
    for shard_id, count in tier._wanted.items():
        if count <= 0:
            raise _fail("I11", "a wanted shard has waiting readers", f"{shard_id}: {count}")
    for shard_id, orphan in tier._orphans.items():
        if orphan.shard_id != shard_id or orphan.pins <= 0 or shard_id in tier._shards:
            raise _fail(
                "I12",
                "an orphan is a dropped copy readers still pin",
                f"{shard_id}: {orphan.pins} pins, in the tier: {shard_id in tier._shards}",
            )
    for shard in tier._evictable():
        if shard.pins or shard.shard_id in tier._wanted:
            raise _fail(
                "I8",
                "a pinned shard, or one a reader waits for (I11), is never evictable",
                f"{shard.shard_id} ({shard.pins} pins) is offered",
            )


def _check_states(tier: Room) -> None:
    """I13, I14, I16: each state's bookkeeping, the files, the policy."""
    ranked = set(tier.policy.victims())
    for shard in tier._shards.values():
        if shard.state is ShardState.READY:
            if shard.index is None:
                raise _fail("I14", "a READY shard has its index", shard.shard_id)
            for path in (tier._tar(shard.shard_id), tier._idx(shard.shard_id)):
                if not path.is_file():
                    raise _fail("I14", "a READY shard's files are on disk", f"no {path}")
            if shard.shard_id not in ranked:
                raise _fail(
                    "I16", "the policy ranks every resident shard", f"{shard.shard_id} unranked"
                )
        elif shard.index is not None or shard.location is not None:
            raise _fail("I14", "a FETCHING shard is never served", f"{shard.shard_id} indexed")
    for url, shard_id in tier._by_url.items():
        current = tier._shards.get(shard_id)
        if current is None or current.state is not ShardState.READY or current.url != url:
            raise _fail(
                "I13",
                "a URL's current version is a READY shard of that URL",
                f"{url} -> {shard_id} ({current.state if current else 'absent'})",
            )
