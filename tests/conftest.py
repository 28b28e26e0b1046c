"""Shared fixtures: a real S3-compatible server (moto) on loopback, port 0."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.daemon import isolate_env
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
