"""The native fetch path (awscrt writing GETs straight into a file) against real stores,
moto and Ceph's RGW, with the fault proxy in front: each guarantee of the aiobotocore
path, and each fault the fill path meets (cut bodies, wrong checksums, 503 SlowDown, a
stalled store, a full disk, cancellation). No mocks: every failure crossed a socket."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import AioSession

from cached.errors import FetchError, FetchTimeout, ObjectNotFound, VerifyError
from cached.sources import native
from cached.sources.base import ObjectChanged, ObjectInfo
from cached.sources.retry import CONNECTION, CORRUPT, SERVER_ERROR, THROTTLED, TIMEOUT
from cached.sources.s3 import S3Source
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_disk import small_disk
from tests.test_sources import MID, PART, SMALL, payload, s3cfg

pytestmark = [
    pytest.mark.stores,
    pytest.mark.skipif(not native.available(), reason="awscrt's S3 client is not importable"),
]


@pytest.fixture(scope="module")
def aio_session() -> Any:
    return AioSession()


class Native:
    """An S3Source on the native path, reporting retries into ``reasons``."""

    def __init__(self, endpoint: str, session: Any, **overrides: Any) -> None:
        self.reasons: list[str] = []
        cfg = s3cfg(endpoint, native_fetch=True, **overrides)
        self.source = S3Source(cfg, self.reasons.append, session=session)

    async def __aenter__(self) -> S3Source:
        src = await self.source.__aenter__()
        assert src.native, "the native path was not taken"
        return src

    async def __aexit__(self, *exc: object) -> None:
        await self.source.__aexit__(None, None, None)


async def nothing(run: Sequence[bytes]) -> None:
    raise AssertionError("the native path handed bytes to the sink")


async def fetched(src: S3Source, info: ObjectInfo, path: Path) -> bytes:
    """Fetch ``info`` into ``path`` natively; the file's bytes."""
    assert await src.fetch(info, nothing, into=path) is True
    return await asyncio.to_thread(path.read_bytes)


SIZES = {"empty": 0, "1B": 1, "small": SMALL, "parts": MID, "exact": 3 * PART}


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("checksum", [None, "CRC32C"])
async def test_the_file_holds_exactly_the_object(
    *,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    size: int,
    checksum: str | None,
) -> None:
    body = payload(size, size)
    s3_server.put(bucket, "obj.tar", body, checksum=checksum)
    path = tmp_path / "obj.tar.partial"
    path.write_bytes(b"old bytes of another attempt, longer than some objects here" * 1000)
    async with Native(s3_server.endpoint_url, aio_session) as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        s3_server.reset_counts()
        assert await fetched(src, info, path) == body
    # One GET per part of [s3] part_size (the CRT splits them), each If-Match the ETag.
    assert s3_server.count("GET", bucket) == -(-size // PART)


async def test_a_body_already_answering_streams_where_it_is(
    s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    # A demand miss opens with a GET (D27): its body is read, not asked for again.
    body = payload(SMALL)
    s3_server.put(bucket, "obj.tar", body)
    got: list[bytes] = []

    async def sink(run: Sequence[bytes]) -> None:
        got.extend(run)

    async with Native(s3_server.endpoint_url, aio_session) as src:
        s3_server.reset_counts()
        async with await src.open(f"s3://{bucket}/obj.tar") as opened:
            path = tmp_path / "x"
            assert await src.fetch(opened.info, sink, opened=opened, into=path) is False
    assert b"".join(got) == body and not path.exists()
    assert s3_server.count("GET", bucket) == 1


FAULTS = [
    pytest.param({"kind": "slowdown"}, THROTTLED, id="503-slowdown"),
    pytest.param({"kind": "error", "status": 500}, SERVER_ERROR, id="500"),
    pytest.param({"kind": "cut", "after_bytes": 20_000}, CONNECTION, id="cut-mid-body"),
    pytest.param({"kind": "cut", "after_bytes": 100, "hard": True}, CONNECTION, id="reset"),
    pytest.param({"kind": "reset"}, CONNECTION, id="reset-before-answer"),
    pytest.param({"kind": "stall", "after_bytes": 1000, "delay_s": 3.0}, TIMEOUT, id="stall"),
]


@pytest.mark.parametrize(("fault", "reason"), FAULTS)
@pytest.mark.parametrize("size", [SMALL, MID], ids=["one-part", "parts"])
async def test_a_transient_failure_is_retried_whole_and_counted(
    *,
    proxy: FaultProxy,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    fault: dict[str, Any],
    reason: str,
    size: int,
) -> None:
    body = payload(size)
    s3_server.put(bucket, "obj.tar", body)
    read_timeout_s = 0.5 if reason == TIMEOUT else 5.0
    native_client = Native(proxy.endpoint_url, aio_session, read_timeout_s=read_timeout_s)
    async with native_client as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        proxy.inject(**fault)
        assert await fetched(src, info, tmp_path / "obj") == body
    assert proxy.faults_left == 0
    # Every retry is one count, by its reason: none hides inside the CRT.
    assert native_client.reasons == [reason]
    gets = proxy.requests("GET")
    assert all(g.if_match == f'"{info.etag}"' for g in gets)


async def test_throttling_past_the_budget_fails_the_fetch(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    s3_server.put(bucket, "obj.tar", payload(SMALL))
    client = Native(proxy.endpoint_url, aio_session, retry_attempts=3)
    async with client as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        proxy.inject("slowdown", times=10)
        with pytest.raises(FetchError, match=r"gave up after 3 attempt\(s\).*SlowDown"):
            await fetched(src, info, tmp_path / "obj")
    assert client.reasons == [THROTTLED, THROTTLED]


async def test_a_stalled_store_is_a_fetch_timeout(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    s3_server.put(bucket, "obj.tar", payload(SMALL))
    client = Native(proxy.endpoint_url, aio_session, retry_attempts=2, read_timeout_s=0.3)
    async with client as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        proxy.inject("delay", times=2, delay_s=3.0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(FetchTimeout, match=r"gave up after 2 attempt\(s\)"):
            await fetched(src, info, tmp_path / "obj")
        assert loop.time() - started < 2.5  # the deadline, not the store, ended each GET
    assert client.reasons == [TIMEOUT]


@pytest.mark.parametrize("checksum", ["CRC32", "CRC32C", "CRC64NVME", None])
@pytest.mark.parametrize("size", [SMALL, MID], ids=["one-part", "parts"])
async def test_a_corrupted_body_is_fetched_again_whole(
    *,
    proxy: FaultProxy,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    checksum: str | None,
    size: int,
) -> None:
    body = payload(size)
    s3_server.put(bucket, "obj.tar", body, checksum=checksum)
    client = Native(proxy.endpoint_url, aio_session)
    async with client as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        # The store's checksum where it keeps one (checked by the CRT), else the ETag's MD5.
        assert (info.checksum is None) == (checksum is None or not s3_server.keeps_checksums)
        proxy.inject("corrupt", offset=1234)
        assert await fetched(src, info, tmp_path / "obj") == body
    assert client.reasons == [CORRUPT]


@pytest.mark.parametrize("checksum", ["CRC32C", None])
async def test_a_body_corrupted_every_time_is_a_verify_error(
    *,
    proxy: FaultProxy,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    checksum: str | None,
) -> None:
    s3_server.put(bucket, "obj.tar", payload(SMALL), checksum=checksum)
    client = Native(proxy.endpoint_url, aio_session, retry_attempts=2)
    async with client as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        proxy.inject("corrupt", offset=7, times=2)
        kind = "MD5" if info.checksum is None else "checksum"
        with pytest.raises(VerifyError, match=re.escape(info.url) + f".*{kind}"):
            await fetched(src, info, tmp_path / "obj")
    assert client.reasons == [CORRUPT]


@pytest.mark.parametrize("size", [SMALL, MID], ids=["one-part", "parts"])
async def test_a_short_body_with_an_honest_length_fails_the_size_check(
    *,
    proxy: FaultProxy,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    size: int,
) -> None:
    # A part shorter than asked for, with a Content-Length that says so: the CRT writes
    # what came and leaves a hole. Without checksums only the byte count catches it.
    s3_server.put(bucket, "obj.tar", payload(size))
    async with Native(proxy.endpoint_url, aio_session, verify_checksum=False) as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        proxy.inject("truncate", drop_bytes=10)
        with pytest.raises(
            VerifyError, match=rf"size mismatch: expected {size} bytes, {size - 10} arrived"
        ):
            await fetched(src, info, tmp_path / "obj")


async def test_a_missing_key_and_a_replaced_object_are_told_apart(
    s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    s3_server.put(bucket, "obj.tar", payload(SMALL, 1))
    async with Native(s3_server.endpoint_url, aio_session) as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        s3_server.put(bucket, "obj.tar", payload(SMALL, 2))
        with pytest.raises(ObjectChanged, match="changed"):
            await fetched(src, info, tmp_path / "obj")
        gone = ObjectInfo(f"s3://{bucket}/gone.tar", info.endpoint, 10, "x", "x")
        s3_server.reset_counts()
        with pytest.raises(ObjectNotFound, match="not found"):
            await fetched(src, gone, tmp_path / "gone")
        assert s3_server.count("GET", bucket) == 1  # a 404 is not retried


async def test_a_full_disk_is_enospc(
    s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    # The fetcher's disk-full handling (evict, fetch again) keys on ENOSPC.
    s3_server.put(bucket, "big.tar", payload(3 << 20))
    with small_disk(tmp_path / "fs", 1) as fs:
        async with Native(s3_server.endpoint_url, aio_session, part_size_bytes=1 << 20) as src:
            info = await src.head(f"s3://{bucket}/big.tar")
            with pytest.raises(OSError) as caught:
                await fetched(src, info, fs / "big.tar.partial")
    assert caught.value.errno == 28


async def test_cancelling_a_fetch_cancels_the_get_at_once(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    # The task's cancellation reaches the CRT: its GET ends, and no CRT thread writes the
    # file afterwards (the fetcher removes it as soon as the task has ended).
    s3_server.put(bucket, "obj.tar", payload(SMALL))
    path = tmp_path / "obj"
    async with Native(proxy.endpoint_url, aio_session) as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        proxy.inject("delay", delay_s=1.0)
        task = asyncio.create_task(src.fetch(info, nothing, into=path))
        for _ in range(500):
            if proxy.requests("GET"):
                break
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        started = loop.time()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert loop.time() - started < 0.9  # not waiting for the store's answer
        await asyncio.sleep(1.5)  # the answer has come, to a request no longer there
    assert not path.exists() or path.stat().st_size == 0
