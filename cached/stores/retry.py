"""Bounded retries with jittered exponential backoff, shared by the remote tiers.

botocore's own retries are switched off in the S3 client: they are unbounded in time
from our point of view, invisible to the metrics, and they would restart a streamed
body from byte 0. Here every request has an explicit budget of attempts, each retry is
reported through a hook (so the daemon can count them by reason), and the caller decides
what a retry re-does (a ranged GET resumes where the delivered bytes end).
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import aiohttp
from botocore import exceptions as boto_exc

from ..config import S3Config
from ..errors import CachedError, FetchError, FetchTimeout
from .pacing import RequestPacer

T = TypeVar("T")

# The reasons a retry is reported with: a small, fixed set, fit for a metric label.
TIMEOUT: Final = "timeout"
CONNECTION: Final = "connection"
THROTTLED: Final = "throttled"
SERVER_ERROR: Final = "server_error"
# A whole body fetched again because it failed its checksum in transit.
CORRUPT: Final = "corrupt"
# A GET held at its headers (a native open) whose body was not let come within its hold:
# the store's answer was given up, and a fresh GET (``If-Match``) brings the body.
HOLD_EXPIRED: Final = "hold_expired"
RETRY_REASONS: Final = (TIMEOUT, CONNECTION, THROTTLED, SERVER_ERROR, CORRUPT, HOLD_EXPIRED)

# S3 and S3-compatible stores say "slow down" with these codes (503 SlowDown is S3's own).
_THROTTLE_CODES: Final = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestThrottled",
        "ServiceUnavailable",
    }
)
# 400 RequestTimeout: the server gave up waiting on the connection; a new request is fine.
_TIMEOUT_CODES: Final = frozenset({"RequestTimeout", "RequestTimeoutException"})

# With a pacer, a request may be throttled this many times its attempts before it fails.
_THROTTLED_TRIES: Final = 4

OnRetry = Callable[[str], None]
Classifier = Callable[[BaseException], str | None]


class StoreUnavailable(FetchError):
    """The retry budget ran out on transient failures (connections refused or reset,
    timeouts, 5xx, throttling): the store did not answer, as opposed to answering no
    (404, 403).

    ``no_connection`` is True when the last attempt could not even connect to the
    endpoint (refused, name not resolved, connect timeout): that says nothing about the
    object asked for, only about the endpoint. Otherwise the failure may be the object's
    own (one key answering 500, or reset, every time); the daemon counts the store as
    unreachable only when several objects fail so (:mod:`cached.store_health`)."""

    no_connection: bool = False


class StoreTimeout(StoreUnavailable, FetchTimeout):
    """:class:`StoreUnavailable` whose last failure was a timeout."""


class HoldExpired(Exception):
    """A GET held at its headers was not let go on within its hold (the caller waited for
    room, or for the request budget, longer): its body was dropped unread. Retried as
    :data:`HOLD_EXPIRED`, by a fresh GET of the version the headers named."""


@dataclass(frozen=True)
class RetryPolicy:
    """How many attempts one request gets and how long to wait between them.

    ``attempts`` counts every try, the first included (``attempts=1``: no retries).
    The wait before retry *n* (1-based) is drawn uniformly from
    ``[0, min(max_delay_s, base_delay_s * 2**(n-1))]`` ("full jitter"), so that many
    clients throttled at once do not come back in lock step.
    """

    attempts: int = 6
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("retry delays cannot be negative")

    @classmethod
    def from_s3_config(cls, cfg: S3Config) -> RetryPolicy:
        """The policy the ``[s3]`` section asks for."""
        return cls(cfg.retry_attempts, cfg.retry_base_delay_s, cfg.retry_max_delay_s)

    def backoff_s(self, retry: int, rng: random.Random | None = None) -> float:
        """The (random) wait before retry number ``retry`` (1 for the first retry)."""
        # Cap the exponent: 2**retry overflows a float long before anyone waits that long.
        ceiling = min(self.max_delay_s, self.base_delay_s * 2.0 ** min(retry - 1, 62))
        return (rng or random).uniform(0.0, ceiling)


def _client_error_reason(exc: boto_exc.ClientError) -> str | None:
    response: dict[str, Any] = exc.response or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if not isinstance(status, int):
        # HEAD errors carry no body; botocore then uses the status as the code.
        status = int(code) if code.isdigit() else 0
    if status == 429 or code in _THROTTLE_CODES:
        return THROTTLED
    if code in _TIMEOUT_CODES:
        return TIMEOUT
    if status >= 500:
        return THROTTLED if status == 503 else SERVER_ERROR
    return None


def transient_reason(exc: BaseException) -> str | None:
    """Why ``exc`` is worth retrying (one of ``RETRY_REASONS``), or None if it is not.

    Transient: HTTP 5xx (503 and 429 count as throttling), timeouts, connections
    refused, reset or closed mid-body, and a held GET's body dropped
    (:class:`HoldExpired`). Not transient: every other HTTP status (404, 403, 412, 416,
    ...), our own errors (a ``VerifyError`` or an exhausted inner budget), and anything
    unknown, which should surface rather than be retried blindly.
    """
    if isinstance(exc, CachedError):
        return None
    if isinstance(exc, HoldExpired):
        return HOLD_EXPIRED
    if isinstance(exc, boto_exc.ClientError):
        return _client_error_reason(exc)
    # Timeouts first: botocore's ReadTimeoutError is also an HTTPClientError, and
    # aiohttp's ServerTimeoutError is also a ClientConnectionError.
    if isinstance(
        exc,
        TimeoutError  # asyncio.TimeoutError is this class since Python 3.11
        | aiohttp.ServerTimeoutError
        | boto_exc.ReadTimeoutError
        | boto_exc.ConnectTimeoutError,
    ):
        return TIMEOUT
    if isinstance(exc, boto_exc.SSLError):
        return None  # a certificate problem does not fix itself
    if isinstance(
        exc,
        aiohttp.ClientConnectionError
        | aiohttp.ClientPayloadError
        | boto_exc.ConnectionError  # EndpointConnectionError, ProxyConnectionError
        | boto_exc.HTTPClientError  # ConnectionClosedError, ResponseStreamingError
        | boto_exc.IncompleteReadError
        | ConnectionError,
    ):
        return CONNECTION
    return None


def no_connection(exc: BaseException) -> bool:
    """Whether ``exc`` says no connection to the endpoint could be made (refused, DNS,
    connect timeout, proxy): the request never reached the store, whatever it asked for.
    A connection reset or closed after the request went out is not one of these."""
    if isinstance(exc, boto_exc.ConnectTimeoutError | boto_exc.ProxyConnectionError):
        return True
    if isinstance(exc, boto_exc.EndpointConnectionError):
        # aiobotocore wraps any aiohttp connection error in this; only some are connects.
        exc = exc.kwargs.get("error") or exc
    return isinstance(exc, aiohttp.ClientConnectorError | socket.gaierror | ConnectionRefusedError)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# I30: SlowDown and transient faults are retried, not failed.
async def retrying(
    op: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    what: str,
    on_retry: OnRetry | None = None,
    classify: Classifier = transient_reason,
    rng: random.Random | None = None,
    pacer: RequestPacer | None = None,
    cost: Callable[[], int] | None = None,
) -> T:
    """Await ``op()`` until it succeeds, retrying what ``classify`` calls transient.

    ``op`` is called afresh for every attempt; anything it must resume (a byte offset)
    it keeps itself. Errors that are not transient propagate unchanged at once. When
    the budget of ``policy.attempts`` runs out, raises :class:`StoreTimeout` (a
    :class:`FetchTimeout`) if the last error was a timeout, else :class:`StoreUnavailable`
    (a :class:`FetchError`); the message names ``what`` (say, the
    request and its URL), the number of attempts and the last error, which is chained.
    ``on_retry(reason)`` is called before each wait. Cancellation is never retried.

    ``pacer``: the endpoint's request budget. Each attempt first takes ``cost()``
    requests from it (1 without ``cost``: the requests ``op`` will send), and reports its
    answer to it. A throttled attempt does not count against ``policy.attempts`` while
    the pacer can still slow down (:meth:`RequestPacer.throttled`): SlowDown is the store
    asking for a lower rate, which the budget then sends at, not a failure of the request.
    Even so a request has at most ``_THROTTLED_TRIES`` times its attempts in all: a store
    that throttles one key whatever the rate does not hold it forever.
    """
    last: Exception | None = None
    reason: str | None = None
    attempt = tries = 0
    while attempt < policy.attempts:
        attempt += 1
        n = 1 if cost is None else cost()
        sent_at = await pacer.acquire(n) if pacer is not None else 0.0
        try:
            result = await op()
        except Exception as exc:
            reason = classify(exc)
            if reason is None:
                raise
            last = exc
            tries += 1
            free = pacer is not None and reason == THROTTLED and pacer.throttled(sent_at)
            if tries >= policy.attempts * _THROTTLED_TRIES or (
                attempt == policy.attempts and not free
            ):
                break
            if free:
                attempt -= 1  # the budget slowed down instead
            if on_retry is not None:
                on_retry(reason)
            await asyncio.sleep(policy.backoff_s(max(attempt, 1), rng))
            continue
        if pacer is not None:
            pacer.succeeded(n)
        return result
    assert last is not None and reason is not None  # the loop ran at least once
    message = f"{what}: gave up after {tries} attempt(s); last error: {_describe(last)}. "
    error: StoreUnavailable
    if reason == TIMEOUT:
        error = StoreTimeout(
            message + "The endpoint is slow or unreachable: check it and the network, "
            "or raise [s3] read_timeout_s / retry_attempts."
        )
    else:
        error = StoreUnavailable(
            message + "The endpoint keeps failing: check its health and the network, "
            "or raise [s3] retry_attempts / retry_max_delay_s."
        )
    error.no_connection = no_connection(last)
    raise error from last
