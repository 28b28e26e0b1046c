"""Exceptions a training script may catch. Each maps from a daemon error code."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .protocol import ErrorCode


class CachedClientError(Exception):
    """Base of the client's errors."""


class DaemonUnavailable(CachedClientError, ConnectionError):
    """The daemon does not answer at the endpoint."""


class RemoteError(CachedClientError, RuntimeError):
    """The daemon answered with an error."""

    # (message, code) and not (code, message): DataLoader re-raises a worker's exception
    # in the main process as ``type(exc)(message)``.
    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class ShardNotFound(RemoteError, FileNotFoundError):
    """The shard URL names no object."""


class NotATar(RemoteError, ValueError):
    """The shard is not a tar archive (or is truncated)."""


class VersionMismatch(RemoteError):
    """Client and daemon speak different protocol versions."""


_BY_CODE: dict[str, type[RemoteError]] = {
    ErrorCode.NOT_FOUND: ShardNotFound,
    ErrorCode.NOT_A_TAR: NotATar,
    ErrorCode.VERSION: VersionMismatch,
}


def remote_error(code: str, message: str) -> RemoteError:
    """The exception for an error reply."""
    return _BY_CODE.get(code, RemoteError)(message, code)


def check_reply(header: Mapping[str, Any]) -> None:
    """Raise the mapped exception if ``header`` is an error reply."""
    if not header.get("ok"):
        raise remote_error(str(header.get("code")), str(header.get("message")))
