"""Exceptions a training script may catch. Every error the client raises derives from
:class:`CachedClientError`, and each is also the standard exception it resembles
(``DaemonUnavailable`` is a ``ConnectionError``, ``DaemonTimeout`` a ``TimeoutError``...), so
code written against the standard types keeps working.

Every class takes a single message argument: a DataLoader re-raises a worker's exception
in the main process as ``type(exc)(message)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The wire's parsers raise these three, so they live there (cached_wire/errors.py).
# Re-exported as they are (the "as" form marks a re-export for mypy's strict mode).
from cached_wire.errors import CachedClientError as CachedClientError  # noqa: PLC0414
from cached_wire.errors import ProtocolError as ProtocolError  # noqa: PLC0414
from cached_wire.errors import UsageError as UsageError  # noqa: PLC0414
from cached_wire.protocol import ErrorCode


class DaemonUnavailable(CachedClientError, ConnectionError):
    """The daemon does not answer at the endpoint."""


class DaemonTimeout(CachedClientError, TimeoutError):
    """The daemon is alive but did not answer a request in time."""


class DeviceUnavailable(CachedClientError, RuntimeError):
    """The device asked for does not exist here (e.g. ``"cuda"`` without CUDA)."""


class StaleBatch(CachedClientError, RuntimeError):
    """A host batch was used after the loader reused its buffers for a later batch."""


class LocalReadsUnavailable(CachedClientError, OSError):
    """Local reads were required (``local_reads=True`` or ``$CACHED_LOCAL_READS=on``) and
    this process cannot read the daemon's hot-tier files, or the daemon does not offer
    them."""


class RemoteError(CachedClientError, RuntimeError):
    """The daemon answered with an error."""

    # (message, code) and not (code, message): see the module's docstring.
    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class ShardNotFound(RemoteError, FileNotFoundError):
    """The shard URL names no object."""


class NotATar(RemoteError, ValueError):
    """The shard is not a tar archive (or is truncated)."""


class VersionMismatch(RemoteError):
    """Client and daemon speak different protocol versions."""


class Forbidden(RemoteError, PermissionError):
    """The daemon does not serve this URL: it is outside the daemon's ``[server] allow``."""


class LimitExceeded(RemoteError):
    """The request would take this client (or its user, or the daemon) past one of the
    daemon's bounds: requests in flight, plans, pinned shards. The message names the
    ``[server]`` key that raises it."""


class RequestTooLarge(CachedClientError, ValueError):
    """A request is larger than the daemon takes (``[server] max_request_bytes``): it was
    not sent (the daemon would drop the connection that sent it)."""


_BY_CODE: dict[str, type[RemoteError]] = {
    ErrorCode.NOT_FOUND: ShardNotFound,
    ErrorCode.NOT_A_TAR: NotATar,
    ErrorCode.VERSION: VersionMismatch,
    ErrorCode.FORBIDDEN: Forbidden,
    ErrorCode.LIMIT: LimitExceeded,
}


def remote_error(code: str, message: str) -> RemoteError:
    """The exception for an error reply."""
    return _BY_CODE.get(code, RemoteError)(message, code)


def check_reply(header: Mapping[str, Any]) -> None:
    """Raise the mapped exception if ``header`` is an error reply."""
    if not header.get("ok"):
        raise remote_error(str(header.get("code")), str(header.get("message")))
