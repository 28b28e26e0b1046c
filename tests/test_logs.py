"""No credential reaches the daemon's log (cached/logs.py): the libraries' loggers stay at
WARNING unless asked for, and what they log when asked for is redacted."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from cached_client import CachedDataset

from cached.logs import MASK, Redactor, setup
from tests.daemon import ProcessDaemon, dataset_shards, serve_config
from tests.s3server import S3Server

# Distinctive, so a hit in the log cannot be anything else.
SECRET = "zSECRETz9KfW2u4Lq8Rt1Vx3Yb5Nc7Md0Pe6Gh2Jk"
TOKEN = "zTOKENzIQoJb3JpZ2luX2VjEJr//////////wEaCXVzLWVhc3QtMSJHMEUCIQD8aB+q=="


@pytest.mark.parametrize(
    "how",
    [
        (["-v"], {}, False, False),
        (["-v", "--debug-libs"], {}, True, False),
        (["-v"], {"CACHED_LOG_LIBS": "1"}, True, False),
        (["-v", "--debug-libs"], {}, True, True),
    ],
    ids=["verbose", "debug-libs", "CACHED_LOG_LIBS", "native"],
)
def test_no_credential_in_the_log_of_a_fetch(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    how: tuple[list[str], dict[str, str], bool, bool],
) -> None:
    """``how``: the command's flags, extra environment, whether the libraries log, and
    whether the GETs are the native path's (awscrt logs nothing through Python's logging:
    botocore's requests, whose headers the redactor blanks, are the HEADs then)."""
    flags, env, libs, native = how
    for i, body in enumerate(dataset_shards(2, 5, payload=500)):
        s3_server.put(bucket, f"c-{i}.tar", body)
    urls = [f"s3://{bucket}/c-{i}.tar" for i in range(2)]
    config, socket = serve_config(tmp_path, s3_server.endpoint_url, native_fetch=native)
    credentials = {"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN}
    with ProcessDaemon(config, socket, env={**credentials, **env}, flags=flags) as daemon:
        assert len(list(CachedDataset(urls, socket=socket))) == 10
        assert daemon.status()["counters"]["fetched_bytes"] > 0
    log = daemon.log.read_text()
    assert "DEBUG cached" in log or "INFO cached" in log
    assert SECRET not in log and TOKEN not in log
    for part in (SECRET[:20], TOKEN[:20], TOKEN[-24:]):  # nor a piece of one
        assert part not in log
    botocore_debug = [line for line in log.splitlines() if " DEBUG botocore" in line]
    if libs and not native:
        # The libraries did log the requests, session-token header and all: redacted.
        assert botocore_debug
        assert "x-amz-security-token" in log.lower() and MASK in log
    elif not libs:
        assert not botocore_debug


def record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("botocore.endpoint", logging.DEBUG, "f", 1, message, args, exc_info)


def redacted(redactor: Redactor, rec: logging.LogRecord) -> str:
    assert redactor.filter(rec)
    return logging.Formatter().format(rec)


def test_the_redactor_blanks_credential_fields_and_values() -> None:
    redactor = Redactor([SECRET, TOKEN, "short"])
    headers = (
        "Sending http request: <AWSPreparedRequest method=GET, headers={'X-Amz-Date': "
        "b'20261201T000000Z', 'X-Amz-Security-Token': b'another-token-value', "
        "'Authorization': b'AWS4-HMAC-SHA256 Credential=AKIAEXAMPLE/20261201/us-east-1/s3/"
        "aws4_request, SignedHeaders=host;x-amz-date, Signature=0123abcd'}>"
    )
    out = redacted(redactor, record("%s", headers))
    assert "another-token-value" not in out and "0123abcd" not in out
    assert "AKIAEXAMPLE" not in out and "X-Amz-Date': b'20261201T000000Z'" in out
    canonical = "CanonicalRequest:\nGET\n/b/k\n\nhost:x\nx-amz-security-token:IQoJb3+/=\n"
    out = redacted(redactor, record(canonical))
    assert "IQoJb3" not in out and f"x-amz-security-token:{MASK}" in out
    query = "https://b.s3/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=feed&X-Amz-Security-Token=t0k"
    out = redacted(redactor, record(query))
    assert "feed" not in out and "t0k" not in out and "AKIA" not in out
    xml = "<Credentials><SecretAccessKey>s3cr3t</SecretAccessKey><SessionToken>tok</SessionToken>"
    out = redacted(redactor, record("Response body: %r", xml))
    assert "s3cr3t" not in out and ">tok<" not in out
    env_dump = "{'AWS_SECRET_ACCESS_KEY': 'abc123', 'aws_session_token': \"def456\"}"
    out = redacted(redactor, record(env_dump))
    assert "abc123" not in out and "def456" not in out
    # The configured values wherever they appear, an exception's text included.
    try:
        raise RuntimeError(f"bad credentials {SECRET} / {TOKEN}")
    except RuntimeError as exc:
        out = redacted(redactor, record("failed for %s", SECRET, exc=exc))
    assert SECRET not in out and TOKEN not in out and "RuntimeError" in out
    # Values too short to be secrets are left alone (test credentials, "demo").
    assert "short" in redacted(redactor, record("s3://short/x.tar"))


def test_bad_arguments_are_not_printed_raw() -> None:
    redactor = Redactor([SECRET])
    rec = record("%s %s", SECRET)  # one argument too few
    out = redacted(redactor, rec)
    assert SECRET not in out


def test_setup_keeps_the_libraries_at_warning_unless_asked() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    levels = {name: logging.getLogger(name).level for name in ("botocore", "aiohttp")}
    try:
        stream = io.StringIO()
        setup(verbose=True, stream=stream, env={"AWS_SESSION_TOKEN": TOKEN})
        logging.getLogger("botocore.endpoint").debug("headers %s", TOKEN)
        logging.getLogger("somelib").info("noise")
        logging.getLogger("somelib").warning("a library's warning, %s", TOKEN)
        logging.getLogger("cached.test").debug("ours")
        out = stream.getvalue()
        assert "headers" not in out and "noise" not in out and "ours" in out
        assert f"a library's warning, {MASK}" in out and TOKEN not in out

        stream = io.StringIO()
        setup(verbose=True, stream=stream, env={"AWS_SESSION_TOKEN": TOKEN, "CACHED_LOG_LIBS": "1"})
        logging.getLogger("botocore.endpoint").debug("headers %s", TOKEN)
        assert f"headers {MASK}" in stream.getvalue()
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
