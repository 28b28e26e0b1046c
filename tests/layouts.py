"""Local replies for the reader tests: a layout written as rows ``[key, [[ext, size,
offset, checksum or None], ...]]``, packed as the daemon packs it (cached/layouts.py),
with the file it describes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cached_client.local import LocalFiles, LocalRead

from cached.hot.index import Member, Sample
from cached.layouts import pack


def packed(rows: list[Any]) -> tuple[bytes, list[str]]:
    """The daemon's packed layout of ``rows`` and its extension names, by index."""
    samples = [
        Sample(key, tuple(Member(m[0], m[2], m[1], m[3]) for m in members)) for key, members in rows
    ]
    made, _ = pack(samples, None)
    return made.frame, made.exts


def local_reply(
    path: Path, rows: list[Any], *, algorithm: str = "xxh3_64", url: str = "s3://b/x.tar"
) -> tuple[dict[str, Any], bytes]:
    """A local read's reply header for ``rows`` of the file ``path``, and its layout frame:
    what the daemon sends (``cached.server.reads.Reads.read``, ``HotTier.locate``)."""
    frame, exts = packed(rows)
    st = path.stat()
    where = {"path": str(path), "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    header = {
        "ok": True,
        "url": url,
        "packed": {"samples": len(rows), "exts": exts},
        "local": {**where, "algorithm": algorithm},
    }
    return header, frame


def no_socket() -> list[Any]:
    raise AssertionError("the read fell back to the socket")


def local_read(files: LocalFiles, path: Path, rows: list[Any], **kw: Any) -> LocalRead:
    """The reader's view of a local reply of ``rows``; a fall back to the socket fails."""
    header, frame = local_reply(path, rows, **kw)
    return LocalRead(files, header, frame, no_socket, lambda exc: None)
