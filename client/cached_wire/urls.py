"""Shard URLs: brace expansion (as WebDataset does) and parsing of ``s3://`` and ``file://``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from .errors import UsageError

_BRACE = re.compile(r"\{([0-9]+)\.\.([0-9]+)\}")
SCHEMES = ("s3", "file")
# What a store allows: an S3 bucket's name is at most 63 characters and an object's key at
# most 1,024 bytes (UTF-8); a local path at most PATH_MAX, 4,096 bytes with its NUL.
MAX_BUCKET_CHARS = 63
MAX_KEY_BYTES = 1024
MAX_PATH_BYTES = 4095
# The longest URL that can name an S3 object: s3://, the bucket, /, and a key of 1,024
# bytes each written as a %XX escape. A longer URL (of any scheme) is refused before it is
# parsed, so that no request can make the daemon hold, or ask a store for, a longer name.
MAX_URL_CHARS = len("s3://") + MAX_BUCKET_CHARS + 1 + 3 * MAX_KEY_BYTES  # 3,141


def expand(pattern: str) -> list[str]:
    """Expand ``{000..127}`` ranges (zero padding kept, several ranges multiply).

    ``s3://b/train-{000..002}.tar`` -> ``[s3://b/train-000.tar, ..., s3://b/train-002.tar]``.
    A comma-separated ``{a,b}`` alternative is expanded too. A brace left over (unbalanced,
    or around something else) raises ``UsageError``: such a URL would name no object, and
    the daemon would say only "not found". A key's own brace is written ``%7B``/``%7D``.
    """
    out = _expand(pattern)
    for url in out:
        if "{" in url or "}" in url:
            raise UsageError(f"bad brace pattern {pattern!r}: {_brace_fault(url)}")
    return out


def _brace_fault(url: str) -> str:
    """What is wrong with the braces left in an expanded URL."""
    depth = 0
    for ch in url:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return "a '}' without its '{'" + _BRACE_HELP
    if depth > 0:
        return "a '{' is not closed" + _BRACE_HELP
    return "a {...} that is neither a range nor a list" + _BRACE_HELP


_BRACE_HELP = (
    "; write {000..009} for a range, {a,b} for a list, and %7B or %7D for a brace in a key"
)


def _expand(pattern: str) -> list[str]:
    match = _BRACE.search(pattern)
    if match is not None:
        lo, hi = match.group(1), match.group(2)
        if int(hi) < int(lo):
            raise UsageError(f"empty brace range {match.group(0)} in {pattern!r}")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        head, tail = pattern[: match.start()], pattern[match.end() :]
        out: list[str] = []
        for i in range(int(lo), int(hi) + 1):
            out.extend(_expand(f"{head}{i:0{width}d}{tail}"))
        return out
    alt = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if alt is not None:
        head, tail = pattern[: alt.start()], pattern[alt.end() :]
        return [u for part in alt.group(1).split(",") for u in _expand(f"{head}{part}{tail}")]
    return [pattern]


def expand_all(urls: str | Iterable[str]) -> list[str]:
    """Expand one pattern or a list of patterns into a flat list of validated URLs."""
    items = [urls] if isinstance(urls, str) else list(urls)
    out = [u for item in items for u in expand(item)]
    if not out:
        raise UsageError("no shard URLs given")
    for url in out:
        parse(url)
    return out


@dataclass(frozen=True)
class ShardURL:
    """A parsed shard URL: ``s3://bucket/key`` or ``file:///abs/path``."""

    scheme: str
    bucket: str
    key: str

    @property
    def path(self) -> str:
        """The local path of a ``file://`` URL."""
        return self.key


# URLs that parse() certainly accepts, matched without parsing: plain s3://bucket/key and
# file:///path with no characters that urlsplit treats specially (query, fragment, escapes,
# user info, port). Anything else goes through parse() for its verdict and its message.
# (urlsplit also drops tabs and line breaks anywhere, and control characters up front.)
# Both are printable ASCII within their store's bounds (a bucket of at most 63 characters, a
# key of at most 1,024, a path within MAX_URL_CHARS), so that a character is a byte. The
# classes are ranges: a negated class with the non-ASCII range costs twice as much a URL.
_PLAIN = re.compile(
    r"s3://[!\x22$&-.0-9;->A-~]{1,63}/+[!\x22$&-.0->@-~][ -\x22$&->@-~]{0,1023}\Z"
    r"|file:///[ -\x22$&->@-~]{0,3133}\Z"  # MAX_URL_CHARS in all
)


def check_all(urls: Iterable[str]) -> None:
    """Validate many URLs (a plan of up to a million) as :func:`parse` would, at a fraction
    of its cost; raises ``UsageError`` naming the first bad one."""
    plain = _PLAIN.match
    for url in urls:
        if not plain(url):
            parse(url)


def parse(url: str) -> ShardURL:
    """Parse and validate a shard URL; raises ``UsageError`` (a ``ValueError``) naming the URL
    (its start only, for one longer than any store allows)."""
    if len(url) > MAX_URL_CHARS:
        raise UsageError(
            f"bad shard URL {url[:80]!r}... ({len(url)} characters): longer than any store "
            f"allows (at most {MAX_URL_CHARS}: an S3 bucket of {MAX_BUCKET_CHARS} characters "
            f"and a key of {MAX_KEY_BYTES} bytes)"
        )
    parts = urlsplit(url)
    if parts.scheme == "s3":
        key = parts.path.lstrip("/")
        if not parts.netloc or not key:
            raise UsageError(f"bad shard URL {url!r}: expected s3://bucket/key")
        name = unquote(key)
        if len(parts.netloc) > MAX_BUCKET_CHARS or len(name.encode(errors="replace")) > (
            MAX_KEY_BYTES
        ):
            raise UsageError(
                f"bad shard URL {url[:80]!r}...: S3 allows a bucket of at most "
                f"{MAX_BUCKET_CHARS} characters and a key of at most {MAX_KEY_BYTES} bytes"
            )
        return ShardURL("s3", parts.netloc, name)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise UsageError(f"bad shard URL {url!r}: expected file:///absolute/path")
        path = unquote(parts.path)
        if len(path.encode(errors="replace")) > MAX_PATH_BYTES:
            raise UsageError(
                f"bad shard URL {url[:80]!r}...: a path is at most {MAX_PATH_BYTES} bytes"
            )
        return ShardURL("file", "", path)
    raise UsageError(f"bad shard URL {url!r}: the scheme must be one of {', '.join(SCHEMES)}")
