"""Shared fixtures: real S3-compatible servers on loopback (moto, and Ceph's RGW).

``s3_server`` is moto's server, except in tests marked ``stores`` (the S3-facing ones):
there it is parametrized over the stores ``CACHED_TEST_STORE`` picks, ids ``moto`` and
``rgw``: ``moto``, ``rgw`` or ``both`` (the default; the rgw half skips, with the reason,
where a Ceph cluster cannot start). ``bucket`` and ``proxy`` follow ``s3_server``, so the
fault proxy sits in front of either store. One server of each kind per session.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from cached_client.transport.channel import Channel

from tests import rgw
from tests.daemon import isolate_env
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server

STORES = ("moto", "rgw")
STORE_ENV = "CACHED_TEST_STORE"


def _chosen_stores() -> tuple[str, ...]:
    value = os.environ.get(STORE_ENV, "both")
    if value == "both":
        return STORES
    if value not in STORES:
        raise pytest.UsageError(f"{STORE_ENV}={value!r}: expected moto, rgw or both")
    return (value,)


def pytest_configure(config: pytest.Config) -> None:
    # Asked for RGW alone and it cannot start: fail now, not skip every test quietly.
    if _chosen_stores() == ("rgw",) and (why := rgw.unavailable()):
        raise pytest.UsageError(f"{STORE_ENV}=rgw, but {why}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("stores") and "s3_server" in metafunc.fixturenames:
        # Module scope: a module's tests run on one store, then on the next, so that its
        # module-scoped fixtures (daemons, datasets) are made once per store.
        stores = _chosen_stores()
        metafunc.parametrize("s3_server", stores, ids=stores, indirect=True, scope="module")


@pytest.fixture(autouse=True)
def _clean_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's own AWS config must not leak into the tests."""
    isolate_env(monkeypatch)


@pytest.fixture(autouse=True)
def _no_log_handler_outlives_its_test() -> Iterator[None]:
    """A test that runs the command line in-process (``logs.setup``) leaves the root
    logger writing to that test's captured stderr, closed once it ends: every later log
    line then prints a "Logging error" traceback, on the thread that logged (a daemon's
    event loop, once per shard). The handlers a test added go with it; pytest's own
    capture handlers are pytest's to remove."""
    root = logging.getLogger()
    before = set(root.handlers)
    yield
    for handler in list(root.handlers):
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[S3Server]:
    """One moto S3 server for the session; tests use their own buckets.

    ``CACHED_TEST_S3_ENDPOINT`` points the tests at another endpoint (e.g. MinIO).
    """
    with S3Server.start(os.environ.get("CACHED_TEST_S3_ENDPOINT")) as server:
        yield server


@pytest.fixture(scope="session")
def rgw_server() -> Iterator[S3Server]:
    """One Ceph cluster with radosgw for the session (tests/rgw.py), 2-3 s to start."""
    if "rgw" not in _chosen_stores():
        pytest.skip(f"{STORE_ENV}=moto")
    why = rgw.unavailable()
    if why:
        if _chosen_stores() == ("rgw",):
            pytest.fail(f"{STORE_ENV}=rgw, but {why}")
        pytest.skip(why)
    with S3Server.start_rgw() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """The store a test runs against: moto, or in tests marked ``stores`` each chosen one."""
    kind = getattr(request, "param", "moto")
    server: S3Server = request.getfixturevalue(f"{kind}_server")
    return server


@pytest.fixture
def bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh, empty bucket named after the test."""
    return s3_server.new_bucket(request.node.name)


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """The fault-injecting proxy in front of the S3 server, for one test. It takes
    request bodies up to 1 MiB, so uploads through it are one-part multipart uploads."""
    with FaultProxy.start(s3_server.endpoint_url) as p:
        yield p


@pytest.fixture
def quick_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe an unreachable store every 0.2 s instead of every 2 s."""
    from cached import lookups

    monkeypatch.setattr(lookups, "PROBE_S", 0.2)


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user may search, for a daemon's socket that other users reach
    (tmp_path's parents are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="cached-public-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# Every client channel made in this process, to close after the test that made it.
_channels: weakref.WeakSet[Channel] = weakref.WeakSet()
_channel_init = Channel.__init__


def _tracked_init(self: Channel, *args: object, **kwargs: object) -> None:
    _channel_init(self, *args, **kwargs)  # type: ignore[arg-type]
    _channels.add(self)


Channel.__init__ = _tracked_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def close_left_channels() -> Iterator[None]:
    """Close the channels a test left open. An unclosed channel's heartbeat thread keeps
    it alive and beating for the rest of the session, and hundreds of them starve the
    daemons that later tests run in this process (a hello unanswered in 5 s, a watcher
    thread that came too late). A channel used again reopens itself."""
    before = set(_channels)
    yield
    for channel in list(_channels):
        if channel not in before:
            channel.close()
