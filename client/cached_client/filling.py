"""The batch being received into one ring slot (FastLoader's): each reply's samples laid
out in the slot's buffers, one per extension, the buffers grown once, then every member
received in one call, and the sizes checked against the layout.

A socket reply's members are received in place from the socket; a local reply's are read
from the shard file, by the compiled reader where it is built (one call lays them out,
one reads and checks them: D32), else in Python after refusing what the compiled one
refuses (:func:`~cached_wire.layouts.check_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cached_wire.layouts import PackedRows, check_rows

from .buffers import Batch, Slot
from .errors import ProtocolError
from .local import LocalRead, laid_out, plan_places
from .resume import Ref
from .transport import Reply


class Filling:
    """The batch being received into one ring slot."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.keys: list[str] = []
        self.offsets: dict[str, list[int]] = {}
        self.used: dict[str, int] = {}
        # The batch's last sample, and whether it ended its part: the position after it.
        self.last: tuple[Ref, bool] = ((0, 0), False)

    def receive(
        self, samples: Sequence[tuple[str, list[list[Any]]]] | PackedRows, reply: Reply
    ) -> None:
        """Receive ``samples`` (the reply's next ones: a socket reply's ``[key, [[ext,
        size], ...]]``, a local reply's packed layout) into the slot.

        Their places are laid out first and the buffers grown once, so that every
        member is received in one call (:meth:`Reply.read_many`: from a local reply, one
        read per run of the file, not one per member)."""
        before = dict(self.used)  # the bytes of earlier replies, kept when a buffer grows
        local = reply.local
        if local is not None and local.plannable():
            assert isinstance(samples, PackedRows)
            self._receive_planned(samples, local, before)
            return
        rows: Sequence[Any]
        if isinstance(samples, PackedRows):
            # The Python reader: the layout decoded, and what the compiled one refuses,
            # refused alike.
            assert local is not None
            rows = local.samples()[samples.first : samples.first + samples.count]
            check_rows(rows, self.used)
        else:
            rows = samples
        places: list[tuple[str, int]] = []  # (ext, at) of each member, in order
        sizes: list[int] = []
        used, offsets, keys = self.used, self.offsets, self.keys
        for key, members in rows:
            n = len(keys)
            for member in members:
                ext, size = member[0], member[1]
                at = used.get(ext, 0)
                places.append((ext, at))
                sizes.append(size)
                used[ext] = at + size
                offsets.setdefault(ext, [0] * (n + 1)).append(at + size)
            keys.append(key)
            if len(members) < len(offsets):
                for offs in offsets.values():
                    if len(offs) < n + 2:  # this sample has no such member
                        offs.append(offs[-1])
        self._grow(before)
        whole = self.slot.views
        views = [whole[ext][at : at + size] for (ext, at), size in zip(places, sizes, strict=True)]
        got = reply.read_many(views)
        wrong = _mismatch(got, sizes)
        if wrong is not None:
            i, what = wrong
            raise ProtocolError(f"{_owner(samples, i)}.{places[i][0]}: {what}")

    def _grow(self, before: dict[str, int]) -> None:
        """Make every buffer hold what is laid out in it, keeping the bytes received
        ``before`` (a batch that began in an earlier reply); grown first, so that the views
        taken after stay valid."""
        for ext, end in self.used.items():
            at = before.get(ext, 0)
            self.slot.region(ext, at, end - at)

    def _receive_planned(
        self,
        samples: PackedRows,
        local: LocalRead,
        before: dict[str, int],
    ) -> None:
        """:meth:`receive` for a local reply, by the compiled reader (D32): one call lays
        the members out, one reads and checks them."""
        exts: list[str] = []
        plan = laid_out(samples, self.used, self.offsets, self.keys, exts, checked=local.checked())
        self._grow(before)
        whole = self.slot.views
        got = local.read_planned(plan, [whole[ext] for ext in exts])
        if got is None:
            return
        places = plan_places(plan)  # fell back to the socket: its frames' sizes, checked
        wrong = _mismatch(got, [size for _e, _at, size in places])
        if wrong is not None:
            i, what = wrong
            raise ProtocolError(f"{_owner(samples, i)}.{exts[places[i][0]]}: {what}")

    def batch(self) -> Batch:
        data = {ext: self.slot.buffers[ext][:n] for ext, n in self.used.items()}
        return Batch(self.keys, data, self.offsets, self.slot)


def _mismatch(got: Sequence[int], sizes: Sequence[int]) -> tuple[int, str] | None:
    """The first member whose frame is not the size its layout announced, and what is
    wrong with it; None when every one is."""
    if list(got) == list(sizes):
        return None
    pairs = enumerate(zip(got, sizes, strict=False))
    i = next((i for i, (n, size) in pairs if n != size), len(got))
    if i < len(got):
        return i, f"a frame of {got[i]} bytes, announced {sizes[i]}"
    return i, "the reply has fewer payload frames than it announced"


def _owner(samples: Sequence[tuple[str, list[list[Any]]]] | PackedRows, member: int) -> str:
    """The key of the sample that member ``member`` of ``samples`` (counted across them)
    belongs to; for an error's message, so that nothing is kept per member to say it."""
    if isinstance(samples, PackedRows):
        return samples.key_of(member)
    for key, members in samples:
        if member < len(members):
            return key
        member -= len(members)
    return samples[-1][0]
