"""The daemon's exceptions: one base, one class per subsystem, mixed with the stdlib type
each resembles so that callers can catch either. Messages say what to do next."""

from __future__ import annotations

from cached_wire.protocol import ErrorCode
from cached_wire.protocol import ProtocolError as _WireProtocolError


class CachedError(Exception):
    """Base of every error the daemon raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL
    # Asking again cannot help (the reply says so: "lasting", docs/protocol.md): the
    # client raises it at once, where it asks again after other transient codes.
    lasting: bool = False


class ConfigError(CachedError, ValueError):
    """Bad configuration: the message names the file and key."""


class FetchError(CachedError, OSError):
    """A shard could not be fetched from its source."""

    code = ErrorCode.FETCH_FAILED


class ObjectNotFound(FetchError, FileNotFoundError):
    """The object does not exist at its source (the URL is in the message)."""

    code = ErrorCode.NOT_FOUND


class ObjectArchived(ObjectNotFound):
    """The object exists but sits in an archive storage class (S3 Glacier Flexible
    Retrieval, Deep Archive, an Intelligent-Tiering archive tier) and is not restored,
    so it cannot be read. A subclass of :class:`ObjectNotFound` because, to a reader,
    it is a miss: the tier chain falls through to the cold tier, and a client sees
    ``not_found`` with the message saying how to fix it.
    """


class FetchTimeout(FetchError, TimeoutError):
    """A fetch ran out of its time or retry budget."""


class VerifyError(FetchError):
    """Downloaded bytes do not match the object's size or checksum."""


class CacheError(CachedError, OSError):
    """The hot tier cannot hold or serve a shard."""


class CacheFull(CacheError):
    """No room: every resident shard is pinned by a reader, or the disk is at its floor."""

    code = ErrorCode.CACHE_FULL


class NeverFits(CacheFull):
    """The shard is larger than the hot tier can ever hold ([cache] capacity, or the file
    system less ``min_free``): no wait or retry makes room."""

    lasting = True


class NotATarError(CacheError, ValueError):
    """The shard's bytes are not a tar archive, or the archive is truncated."""

    code = ErrorCode.NOT_A_TAR


class VersionMismatch(CachedError):
    """A client speaks another protocol version."""

    code = ErrorCode.VERSION


class LimitExceeded(CachedError):
    """A client asked for more state (plans, pinned shards) than one client may hold."""

    code = ErrorCode.LIMIT


class UnknownDataset(CachedError):
    """A plan names a dataset the daemon does not hold; the client tells it and retries."""

    code = ErrorCode.UNKNOWN_DATASET


class OutOfRange(CachedError, IndexError):
    """A read past the last sample of a shard."""

    code = ErrorCode.OUT_OF_RANGE


class ProtocolError(CachedError, _WireProtocolError):
    """A client sent a malformed request."""

    code = ErrorCode.BAD_REQUEST
