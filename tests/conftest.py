"""Shared fixtures: a real S3-compatible server (moto) on loopback, port 0."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.daemon import isolate_env
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server


@pytest.fixture(autouse=True)
def _clean_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's own AWS config must not leak into the tests."""
    isolate_env(monkeypatch)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the session; tests use their own buckets.

    ``CACHED_TEST_S3_ENDPOINT`` points the tests at another endpoint (e.g. MinIO).
    """
    with S3Server.start(os.environ.get("CACHED_TEST_S3_ENDPOINT")) as server:
        yield server


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
