"""Which shard URLs a client may ask for: ``[server] allow``, a list of URL prefixes.

Anyone who can connect to the socket can name a URL, and the daemon reads it with its own
rights: without a limit a ``file://`` URL would read any file the daemon can (every
world-readable file of the node, whatever a pod mounts). The default, ``["s3://"]``,
admits every S3 URL (the store's credentials are what bound those) and no ``file://`` URL.

A URL is admitted only if two forms of it both start with an allowed prefix:

- the *lexical* form: ``.`` and ``..`` resolved as text (``file:///data/../etc/passwd`` is
  ``file:///etc/passwd``; ``s3://b/a/../x`` is ``s3://b/x``, as the HTTP layer sends it);
- for ``file://``, the *real* form: the path with every symlink resolved, as the kernel
  will open it (a symlink inside an allowed directory that points out of it is refused).
  The prefixes are resolved the same way, so an allowed directory may itself be a link.

A URL whose lexical form is outside every prefix is refused without touching the file
system, so the answer cannot tell whether such a path exists. The refusal's message is
the same whatever the path. What stays possible: a user who can write inside an allowed
directory can swap a file for a symlink between this check and the read; allow only
directories that untrusted users cannot write to.

A request's ``file://`` URL that was admitted is admitted again without a look for
:data:`ADMITTED_S` (a reader names each shard in its open ahead, its open, its read and
the release of its pin, within moments): the check that consults the file system runs in
a worker thread, and that hand-off was a third of the daemon's CPU per shard served to
local readers (docs/decisions.md, D30). So a link swapped inside an allowed directory is
refused up to that long later. Refusals are not remembered, nor are a plan's URLs.
"""

from __future__ import annotations

import asyncio
import operator
import os
import posixpath
import re
import time
from collections.abc import Iterable, Sequence
from itertools import compress, repeat

from cached_wire.protocol import ErrorCode
from cached_wire.urls import ShardURL, parse

from .errors import CachedError

DEFAULT_ALLOW = ("s3://",)
# A plan names up to a million URLs: checked in a worker thread beyond this many.
_INLINE_MAX = 64
# How long a request's admitted URL is admitted again without a look (see the module's
# doc), and how many such URLs are remembered at most.
ADMITTED_S = 2.0
ADMITTED_MAX = 65_536
# An s3:// URL whose text is its own lexical form and the key parse() finds: no escapes,
# query, fragment, user info or port, no whitespace (urlsplit drops tabs and newlines), no
# "." or ".." segment and no "//". A prefix match of the text itself settles it.
_PLAIN_S3 = re.compile(r"s3://[^/?#%@:\s\x00-\x1f]+(?!.*(?://|/\.))/[^?#%\s\x00-\x1f]+\Z")


class Forbidden(CachedError, PermissionError):
    """A client asked for a URL outside ``[server] allow``."""

    code = ErrorCode.FORBIDDEN


# I69: only allowed URLs are served.
class Access:
    """The ``[server] allow`` check. ``await access.check(urls)`` raises :class:`Forbidden`
    for the first URL not admitted, or ``UsageError`` (a ``ValueError``) for a bad URL."""

    def __init__(self, allow: Sequence[str] = DEFAULT_ALLOW) -> None:
        self.allow = tuple(allow)
        self._s3 = tuple(p for p in self.allow if p.startswith("s3://"))
        self._all_s3 = "s3://" in self._s3  # the default
        # Directories, lexically normalized and ending with "/".
        self._dirs = tuple(
            _as_dir(posixpath.normpath(parse_prefix(p)))
            for p in self.allow
            if p.startswith("file://")
        )
        # URL -> until when it is admitted without a look (a request's, not a plan's).
        self._admitted: dict[str, float] = {}

    def settled(self, urls: Sequence[str]) -> bool:
        """Whether every URL of a request is admitted without a look: an ``s3://`` URL
        where all are allowed (the default), or one admitted in the last
        :data:`ADMITTED_S`. The serving path asks this first, to spare itself
        :meth:`check` (a coroutine and a walk) for what it asked moments ago."""
        now = time.monotonic()
        admitted = self._admitted
        return all(
            admitted.get(u, 0.0) > now or (self._all_s3 and u.startswith("s3://")) for u in urls
        )

    async def check(self, urls: Iterable[str], *, remember: bool = False) -> None:
        """Check every URL. A few ``s3://`` URLs (an open, a read) are checked at once; a
        plan's many, or any other URL (``file://`` ones consult the file system), in a
        worker thread, so that the event loop keeps serving. With ``remember`` (a
        request's URLs, not a plan's), the URLs admitted after a look are admitted again
        without one for :data:`ADMITTED_S` (see :meth:`settled`)."""
        given = list(urls)
        if len(given) <= _INLINE_MAX and all(u.startswith("s3://") for u in given):
            self._check_all(self._needs_a_look(given))
            return
        now = time.monotonic()
        looked = await asyncio.to_thread(self._checked, given)
        if remember:
            self._remember(looked, now + ADMITTED_S)

    def _checked(self, given: list[str]) -> list[str]:
        """Check ``given``; returns the URLs that needed a look (all admitted)."""
        look = self._needs_a_look(given)
        self._check_all(look)
        return look

    def _remember(self, urls: list[str], until: float) -> None:
        """``urls`` were admitted: they are again, without a look, until ``until``."""
        if len(self._admitted) + len(urls) > ADMITTED_MAX:
            now = time.monotonic()
            self._admitted = {u: t for u, t in self._admitted.items() if t > now}
            if len(self._admitted) + len(urls) > ADMITTED_MAX:
                self._admitted.clear()
        self._admitted.update(dict.fromkeys(urls, until))

    def _needs_a_look(self, given: list[str]) -> list[str]:
        """The distinct URLs a plain prefix match cannot settle. A plan names up to a
        million, nearly always plain ``s3://bucket/key``: those are settled here at C
        speed (``str.startswith`` through ``map``), without parsing each one."""
        if self._all_s3:
            # Every s3:// URL is admitted: only the others need a look.
            keep: Iterable[bool] = map(operator.not_, map(str.startswith, given, repeat("s3://")))
        elif self._s3:
            plain = map(bool, map(_PLAIN_S3.match, given))
            admitted = map(str.startswith, given, repeat(self._s3))
            keep = map(operator.not_, map(operator.and_, plain, admitted))
        else:
            keep = repeat(True)
        return list(dict.fromkeys(compress(given, keep)))

    def _check_all(self, urls: list[str]) -> None:
        real_dirs: dict[str, str] = {}  # per check: shards share a few directories
        for url in urls:
            shard = parse(url)
            if shard.scheme == "s3":
                self._check_s3(url, shard)
            else:
                self._check_file(url, shard.path, real_dirs)

    def _check_s3(self, url: str, shard: ShardURL) -> None:
        literal = f"s3://{shard.bucket}/{shard.key}"
        # "s3://b/../other/k" reaches bucket "other" once the HTTP layer resolves the dots.
        lexical = "s3:/" + posixpath.normpath(f"/{shard.bucket}/{shard.key}")
        if not (_under(literal, self._s3) and _under(lexical, self._s3)):
            raise self._refuse(url)

    def _check_file(self, url: str, path: str, real_dirs: dict[str, str]) -> None:
        if "\0" in path or not _under(posixpath.normpath(path), self._dirs):
            raise self._refuse(url)
        allowed_real = tuple(_as_dir(_realpath(d, real_dirs)) for d in self._dirs)
        if not _under(_real_file(path, real_dirs), allowed_real):
            raise self._refuse(url)

    def _refuse(self, url: str) -> Forbidden:
        # The same words for a path that exists and one that does not.
        return Forbidden(
            f"{url} is not allowed: this cached daemon serves only URLs under "
            f"{', '.join(self.allow)} ([server] allow); ask its administrator to allow a "
            "prefix that covers it"
        )


def parse_prefix(prefix: str) -> str:
    """The path of a ``file://`` prefix (``file:///data/`` -> ``/data/``)."""
    return prefix[len("file://") :]


def _as_dir(path: str) -> str:
    return path if path.endswith("/") else path + "/"


def _under(candidate: str, prefixes: Iterable[str]) -> bool:
    return any(candidate.startswith(p) for p in prefixes)


def _realpath(path: str, cache: dict[str, str]) -> str:
    if path not in cache:
        cache[path] = os.path.realpath(path)
    return cache[path]


def _real_file(path: str, real_dirs: dict[str, str]) -> str:
    """``os.path.realpath(path)``, resolving each directory once per check: a plan's
    shards share a few directories, and only the last component needs a look of its own."""
    head, name = posixpath.split(path)
    if name in ("", ".", "..") or os.path.islink(path):
        return os.path.realpath(path)
    return posixpath.join(_realpath(head, real_dirs), name)
