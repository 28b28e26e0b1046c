"""The errors the wire's parsers raise: a bad URL (:class:`UsageError`) and a reply that
breaks the protocol (:class:`ProtocolError`). Their base is the client library's,
:class:`CachedClientError`, so that a training script that catches the client's errors
catches these too; ``cached_client.errors`` re-exports all three. The daemon meets them
as the ``ValueError`` and ``protocol.ProtocolError`` they also are."""

from __future__ import annotations

from . import protocol


class CachedClientError(Exception):
    """Base of the client's errors."""


class UsageError(CachedClientError, ValueError):
    """An argument the client cannot work with (a bad URL, rank, batch size or view)."""


class ProtocolError(CachedClientError, protocol.ProtocolError):
    """The daemon sent something that does not follow the protocol (a bad header, a
    payload frame of the wrong size or a missing one)."""
