"""The request checks: each field a handler takes, of the type and within the bounds it
must be, or a :class:`ProtocolError` (``bad_request``) naming it. Pure functions, no state
but the cache of URLs already found valid."""

from __future__ import annotations

import functools
import re
from typing import Any

from cached_wire.protocol import Header, Op, decode
from cached_wire.protocol import ProtocolError as WireProtocolError
from cached_wire.urls import parse

from ..errors import ProtocolError

# Requests nest two levels (a plan's list of URLs); deeper JSON is refused when decoded, so
# no handler ever walks (or prints) a structure deep enough to exhaust the stack.
MAX_REQUEST_DEPTH = 8
# Headers larger than this are decoded off the event loop (and a refused one's id is
# found without decoding it).
DECODE_OFFLOAD_BYTES = 1 << 20
# URLs one request may release (a reader holds a few pins at a time).
MAX_RELEASED = 64


def request_id(header: Header) -> int | None:
    """The request's ``id``, echoed in the reply: an integer, or absent."""
    value = header.get("id")
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ProtocolError("request field 'id' must be an integer")


def op_of(header: Header) -> str:
    """The request's ``op``: a string (an unknown one is refused by the dispatch)."""
    value = header.get("op")
    if not isinstance(value, str):
        raise ProtocolError(f"request field 'op' must be one of {', '.join(Op)}")
    return value


def listed(header: Header, most: int, what: str) -> list[Any]:
    """The request's ``urls``: a list of at most ``most`` (checked item by item later)."""
    urls = header.get("urls")
    if not isinstance(urls, list):
        raise ProtocolError("request field 'urls' must be a list of strings")
    if len(urls) > most:
        raise ProtocolError(f"{what} may name at most {most} shards")
    return urls


def text(header: Header, name: str) -> str:
    """The request's field ``name``: a non-empty string."""
    value = header.get(name)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"request field {name!r} must be a non-empty string")
    return value


def url_of(header: Header) -> str:
    """The request's ``url``: a shard URL."""
    url = text(header, "url")
    valid(url)  # ValueError naming the URL: a bad request, not a failed fetch
    return url


@functools.lru_cache(maxsize=1 << 14)  # a reader names each shard in a few requests
def valid(url: str) -> None:
    """Raise ``ValueError`` naming ``url`` if it is not a shard URL (remembered if it is)."""
    parse(url)


# I65: malformed requests are bad_request (as every check here).
def released(header: Header) -> list[str]:
    """The ``release`` field: the URLs whose pins the stream gives back with this request,
    each a shard URL (no store is asked about a name no store allows)."""
    urls = header["release"]
    if not (isinstance(urls, list) and len(urls) <= MAX_RELEASED):
        raise ProtocolError(f"request field 'release' must list at most {MAX_RELEASED} URLs")
    if not all(isinstance(u, str) and u for u in urls):
        raise ProtocolError("request field 'release' must be a list of URLs")
    for url in urls:
        valid(url)
    return urls


def integer(header: Header, name: str, low: int = 0) -> int:
    """The request's field ``name``: an integer of at least ``low``."""
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ProtocolError(f"request field {name!r} must be an integer >= {low}")
    return value


_ID = re.compile(rb'"id":\s*(\d{1,18})\s*[,}]')


def id_of(header: bytes) -> int | None:
    """A refused request's ``id``, without decoding a large frame: the client library puts
    it last, and short requests are decoded. None where it cannot be told."""
    if len(header) <= DECODE_OFFLOAD_BYTES:
        try:
            value = decode(header).get("id")
        except (WireProtocolError, ValueError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    found = _ID.search(header, len(header) - 64)
    return int(found.group(1)) if found else None
