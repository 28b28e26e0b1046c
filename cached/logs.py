"""Logging for the ``cached`` command: one stderr handler, third-party loggers kept quiet,
and credentials redacted from every line.

``cached -v`` turns on the daemon's own debug lines. The libraries' (botocore, aiohttp...)
stay at WARNING unless asked for with ``--debug-libs`` or ``CACHED_LOG_LIBS=1``: botocore's
debug output logs every request's headers, the ``x-amz-security-token`` of temporary
credentials included. As a second line of defence, whatever is logged passes a
:class:`Redactor` that blanks credential-shaped fields and the credential values this
process was given.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import TextIO

LIBS_ENV = "CACHED_LOG_LIBS"
# Loggers of the libraries the daemon uses: set to WARNING unless asked for. Their level,
# not only the handler's filter, so that botocore does not even format its debug lines.
THIRD_PARTY = (
    "botocore",
    "aiobotocore",
    "boto3",
    "s3transfer",
    "urllib3",
    "aiohttp",
    "asyncio",
    "moto",
    "werkzeug",
)
# Whose lines below WARNING are shown without --debug-libs (any other library's are not).
OWN = ("cached", "cached_client", "__main__")
# Environment variables whose values are credentials: redacted wherever they appear.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
# Shorter values are not redacted as text: "demo" or "testing" (test and demo credentials)
# would blank every URL that contains the word. Real secrets are 40 characters and more.
MIN_SECRET_LEN = 8
MASK = "***"

_KEYS = (
    r"x-amz-security-token|x-amz-signature|x-amz-credential|authorization"
    r"|aws_secret_access_key|aws_session_token|aws_security_token"
    r"|secret_access_key|secretaccesskey|session_token|sessiontoken|secret_key"
    r"|signature|credential|token"
)
# 'Authorization': b'AWS4-HMAC-SHA256 Credential=..., Signature=...' (botocore's headers).
_QUOTED = re.compile(rf"(?i)\b({_KEYS})(['\"]?\s*[:=]\s*b?)(['\"])(.*?)(?<!\\)\3")
# x-amz-security-token:IQoJb3...  (a canonical request), X-Amz-Signature=abc (a query).
_BARE = re.compile(rf"(?i)\b({_KEYS})(\s*[:=]\s*)(?!['\"\s]|{re.escape(MASK)})([^\s'\",;&}}<]+)")
# <SecretAccessKey>...</SecretAccessKey> (an STS response body).
_XML = re.compile(r"(?i)<(SecretAccessKey|SessionToken|Token)>[^<]*</\1>")


def truthy(value: str | None) -> bool:
    """An environment switch: 1, true, yes, on."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class Redactor(logging.Filter):
    """Blanks credentials in a record's message, exception and stack text.

    What it knows: header and field names that carry credentials (``Authorization``,
    ``x-amz-security-token``, ``aws_secret_access_key``...), STS's XML elements, and the
    literal ``secrets`` given (the values of :data:`SECRET_ENV`, by default)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        # Longest first: a value that contains another is blanked whole.
        self.secrets = sorted({s for s in secrets if len(s) >= MIN_SECRET_LEN}, key=len)[::-1]

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Redactor:
        """A redactor for the credential values in ``env`` (default: ``os.environ``)."""
        env = os.environ if env is None else env
        return cls(env[name] for name in SECRET_ENV if env.get(name))

    def redact(self, text: str) -> str:
        """``text`` with every credential it recognizes replaced by ``***``."""
        for secret in self.secrets:
            text = text.replace(secret, MASK)
        text = _QUOTED.sub(lambda m: f"{m[1]}{m[2]}{m[3]}{MASK}{m[3]}", text)
        text = _BARE.sub(lambda m: f"{m[1]}{m[2]}{MASK}", text)
        return _XML.sub(lambda m: f"<{m[1]}>{MASK}</{m[1]}>", text)

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record in place (every handler after this one sees it redacted)."""
        try:
            message = record.getMessage()
        except Exception:  # bad arguments: logging would print them raw in its complaint
            message = f"{record.msg} (with arguments that do not fit it)"
        record.msg, record.args = self.redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


class OwnBelowWarning(logging.Filter):
    """Lets through WARNING and above from anyone, lower levels only from ``cached`` itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        """True for a record to show."""
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in OWN


def setup(
    verbose: bool = False,
    libs: bool | None = None,
    stream: TextIO | None = None,
    env: Mapping[str, str] | None = None,
) -> logging.Handler:
    """Configure the root logger for the command line; returns the handler.

    ``verbose``: DEBUG instead of INFO. ``libs``: the libraries' lines at that level too
    (None: ``$CACHED_LOG_LIBS``). Under systemd (``$JOURNAL_STREAM``) lines carry no time
    stamp: the journal stamps each line itself.
    """
    env = os.environ if env is None else env
    if libs is None:
        libs = truthy(env.get(LIBS_ENV))
    stamp = "" if env.get("JOURNAL_STREAM") else "%(asctime)s "
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(stamp + "%(levelname)s %(name)s: %(message)s"))
    if not libs:
        handler.addFilter(OwnBelowWarning())
    handler.addFilter(Redactor.from_environment(env))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.NOTSET if libs else logging.WARNING)
    return handler
