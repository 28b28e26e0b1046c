"""Shared fixtures: a real S3-compatible server (moto) on loopback, port 0."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.s3server import S3Server


@pytest.fixture(autouse=True)
def _clean_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's own AWS config must not leak into the tests."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "CACHED_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")


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
