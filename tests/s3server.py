"""A real S3-compatible HTTP server on loopback for tests and benchmarks.

moto's ``ThreadedMotoServer`` on port 0 (no MinIO server installs from the package
registries); Ceph's RADOS Gateway, a real engine (:mod:`tests.rgw`); or any endpoint given
by URL. Counts requests by method at the server (moto: in its WSGI app; RGW: from its ops
log), so a test can assert "no GET" without trusting the daemon's own bookkeeping.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.exceptions import ClientError

_counter = itertools.count()


@dataclass
class S3Server:
    """A running S3 endpoint with a boto3 client for setting up data."""

    endpoint_url: str
    client: Any
    #: Which engine answers: ``moto``, ``rgw`` or ``endpoint`` (given by URL, not counted).
    kind: str = "endpoint"
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: The store's own processes (RGW's daemons), for a benchmark to read their CPU time;
    #: empty for moto (a thread of this process) and an endpoint given by URL.
    pids: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # RGW: makes a marker request and waits until the ops log has shown it.
    _sync: Callable[[], None] | None = None

    @classmethod
    @contextmanager
    def start(cls, endpoint_url: str | None = None) -> Iterator[S3Server]:
        """Start moto on 127.0.0.1:0 (or use ``endpoint_url``) and stop it afterwards."""
        if endpoint_url:
            yield cls(endpoint_url, _client(endpoint_url))
            return
        from moto.server import ThreadedMotoServer

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        try:
            host, port = moto.get_host_and_port()
            server = cls(f"http://{host}:{port}", _client(f"http://{host}:{port}"), "moto")
            server._install_counter(moto)
            yield server
        finally:
            moto.stop()

    @classmethod
    @contextmanager
    def start_rgw(cls, frontend: str = "") -> Iterator[S3Server]:
        """Start a single-node Ceph cluster with radosgw (:class:`tests.rgw.RGW`, with
        ``frontend`` options; raises :class:`tests.rgw.RGWUnavailable` if it cannot start
        here) and stop it afterwards."""
        from tests.rgw import RGW, OpsLog

        with RGW.start(frontend=frontend) as rgw:
            server = cls(rgw.endpoint_url, _client(rgw.endpoint_url), "rgw")
            server.pids = list(rgw.pids.values())
            ops = OpsLog(rgw.root / "run" / "ops.sock", server._record)
            ops.start()
            marker_bucket = "cached-ops-sync"
            server.client.create_bucket(Bucket=marker_bucket)
            markers = itertools.count()

            def sync() -> None:
                marker = str(next(markers))
                with suppress(ClientError):  # a 404, and logged as such
                    server.client.head_object(Bucket=marker_bucket, Key=f"__sync__/{marker}")
                ops.wait_for(marker)

            server._sync = sync
            try:
                yield server
            finally:
                ops.close()

    @property
    def keeps_checksums(self) -> bool:
        """Whether the store keeps an upload's ``x-amz-checksum-*`` and returns it with
        HEAD and GET (``ChecksumMode``). Ceph 16.2's RGW ignores it: only the ETag."""
        return self.kind != "rgw"

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests[(method, path)] += 1

    def _install_counter(self, moto: Any) -> None:
        app = moto._server.app  # werkzeug app behind the threaded server
        inner = moto._server.app

        def counting(environ: dict[str, Any], start_response: Any) -> Any:
            self._record(environ.get("REQUEST_METHOD", "?"), environ.get("PATH_INFO", ""))
            return inner(environ, start_response)

        del app
        moto._server.app = counting

    def count(self, method: str, path_pattern: str = ".*") -> int:
        """How many requests with ``method`` whose path matches ``path_pattern`` the server saw."""
        rx = re.compile(path_pattern)
        if self._sync is not None:
            self._sync()
        with self._lock:
            return sum(n for (m, p), n in self.requests.items() if m == method and rx.search(p))

    def reset_counts(self) -> None:
        """Forget the request counts."""
        if self._sync is not None:
            self._sync()
        with self._lock:
            self.requests.clear()

    def new_bucket(self, hint: str = "b") -> str:
        """Create a bucket with a unique, valid name (3-63 characters; RGW enforces it)."""
        name = re.sub(r"[^a-z0-9-]", "-", hint.lower())[:40].strip("-") or "b"
        name = f"{name}-{next(_counter)}".lstrip("-")
        self.client.create_bucket(Bucket=name)
        return name

    def put(
        self, bucket: str, key: str, body: bytes, checksum: str | None = "CRC32", **extra: Any
    ) -> None:
        """Upload one object with a full-object checksum (``CRC32``, boto3's default,
        ``CRC32C``, ``CRC64NVME``), or with none (as older tools upload); ``extra`` are
        more ``put_object`` arguments."""
        if self.kind == "rgw" and extra.get("ServerSideEncryption") == "aws:kms":
            extra.setdefault("SSEKMSKeyId", "testkey-1")  # tests/rgw.py's test KMS key
        if checksum is None:
            _client(self.endpoint_url, checksums=False).put_object(
                Bucket=bucket, Key=key, Body=body, **extra
            )
        else:
            self.client.put_object(
                Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm=checksum, **extra
            )


def _client(endpoint_url: str, checksums: bool = True) -> Any:
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(
            s3={"addressing_style": "path"},  # RGW here has no DNS name for buckets
            # Without: no checksum unless an operation requires one (PUT does not).
            request_checksum_calculation="when_supported" if checksums else "when_required",
        ),
    )
