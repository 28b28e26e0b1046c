"""Wire protocol v1 between the cached daemon and its clients (standard library only).

Transport: a ZeroMQ ROUTER on the daemon, a DEALER per client stream. Every message is
multipart: one JSON header frame, then zero or more raw payload frames. A reply carries
the ``id`` of its request, so a client may keep several requests in flight and match
replies in any order. See ``docs/protocol.md`` for the full description.

Requests (header fields):

- ``{"op": "hello", "id", "v"}`` -> ``{"id", "ok", "v", "server", "instance", "features"}``
- ``open`` and ``read`` may carry ``"release": [url, ...]`` (where ``features`` has
  ``"release"``): the stream's pins on those shards go first, as with ``close``.
- ``{"op": "open", "id", "url", "stream"}`` -> ``{"id", "ok", "url", "samples", "size",
  "hit"}``; fetches the shard first if it is not in the hot tier (a demand miss; then
  ``hit`` is false).
- ``{"op": "read", "id", "url", "stream", "start", "count"}`` -> ``{"id", "ok", "start",
  "next", "end", "samples": [[key, [[ext, size], ...]], ...]}`` followed by one payload
  frame per member, in order. Reads address samples by (url, index), so a client that
  reconnects continues at the exact next sample.
- ``{"op": "close", "id", "url", "stream"}`` -> ``{"id", "ok"}``: releases the stream's pin.
- ``{"op": "status", "id"}`` -> ``{"id", "ok", "status": {...}}``.
- ``{"op": "plan", "id", "plan", "urls", "cursor", "job"}`` -> ``{"id", "ok"}``: the
  stream's future shard order (this epoch, then the next); ``read`` requests carry
  ``plan`` and ``pos`` (the index in ``urls`` being read) to move its cursor.
- ``{"op": "dataset", "id", "dataset", "urls"}`` -> ``{"id", "ok"}`` (where ``features``
  has ``"datasets"``): a dataset's URL list, named by :func:`catalog.catalog_id`; a
  ``plan`` may then carry ``"dataset"`` and ``"index"`` (base64 of 32-bit positions in
  that list) instead of ``"urls"``.
- ``{"op": "report", "id", "job", "reporter", "wait_s", "loop_s", "batches", "ready"}`` ->
  ``{"id", "ok"}``: a training process's cumulative time waiting for data, loop time,
  batches and batches ready, for the daemon's per-job metrics.

Errors: ``{"id", "ok": false, "code", "message"}`` with ``code`` from :class:`ErrorCode`.
"""

from __future__ import annotations

import json
import struct
from enum import StrEnum
from typing import Any

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "ipc:///run/cached/cached.sock"
SOCKET_ENV = "CACHED_SOCKET"

Header = dict[str, Any]


class Op(StrEnum):
    """Request operations."""

    HELLO = "hello"
    OPEN = "open"
    READ = "read"
    CLOSE = "close"
    STATUS = "status"
    PLAN = "plan"
    REPORT = "report"
    HEARTBEAT = "heartbeat"
    DATASET = "dataset"


class ErrorCode(StrEnum):
    """Error codes carried in error replies; clients map them to exception types."""

    BAD_REQUEST = "bad_request"
    VERSION = "version_mismatch"
    NOT_FOUND = "not_found"
    # The URL is outside the daemon's [server] allow list (whether or not it exists).
    FORBIDDEN = "forbidden"
    NOT_A_TAR = "not_a_tar"
    FETCH_FAILED = "fetch_failed"
    CACHE_FULL = "cache_full"
    OUT_OF_RANGE = "out_of_range"
    UNAVAILABLE = "unavailable"
    LIMIT = "limit_exceeded"
    # A plan names a dataset the daemon does not hold (never told, restarted, or let go
    # when no plan named it): the client tells it the dataset and sends the plan again.
    UNKNOWN_DATASET = "unknown_dataset"
    # Not an answer: the daemon stopped before it could answer. The client keeps the
    # request and sends it again to the daemon's successor.
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


# One member of a packed layout, the layout of every local reply (docs/protocol.md,
# "Local reads"; D34, D41): extension index, flags (1: the checksum is known), size,
# offset, checksum. The daemon packs it (cached/layouts.py); the client's compiled
# reader (client/csrc/_gather.c) and its Python one (layouts.unpacked) read it.
PACKED_MEMBER = struct.Struct("<IIQQQ")


class ProtocolError(Exception):
    """A message that does not follow the protocol."""


def encode(header: Header) -> bytes:
    """Encode a header frame."""
    return encode_value(header)


def encode_value(value: Any) -> bytes:
    """Any JSON value as a header frame would encode it (compact)."""
    return json.dumps(value, separators=(",", ":")).encode()


def decode(frame: bytes | memoryview, max_depth: int | None = None) -> Header:
    """Decode a header frame; raises :class:`ProtocolError` on anything but a JSON object,
    and on one nested deeper than ``max_depth`` levels (the object itself is level 1)."""
    try:
        header = json.loads(bytes(frame))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header frame is not JSON: {exc}") from exc
    except RecursionError:
        # The decoder recurses once per level: thousands of "[" exhaust the stack before
        # any depth check could run. A malformed message, not a failure of the reader.
        raise ProtocolError("header frame is nested too deeply") from None
    if not isinstance(header, dict):
        raise ProtocolError("header frame must be a JSON object")
    if max_depth is not None and _depth_exceeds(header, max_depth):
        raise ProtocolError(f"header frame is nested more than {max_depth} levels deep")
    return header


_CONTAINERS = frozenset((dict, list))  # what json.loads nests


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/objects more than ``limit`` levels (iteratively: the
    walk must not recurse on the very input it guards against)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        # map(type) runs in C: a plan's million URL strings cost milliseconds, not a loop.
        if not _CONTAINERS.isdisjoint(map(type, children)):
            stack.extend((c, depth + 1) for c in children if type(c) in _CONTAINERS)
    return False


def error(request_id: Any, code: ErrorCode, message: str) -> Header:
    """Build an error reply header."""
    return {"id": request_id, "ok": False, "code": code.value, "message": message}
