"""The native fetch path (awscrt writing GETs straight into a file) against real stores,
moto and Ceph's RGW, with the fault proxy in front: each guarantee of the aiobotocore
path, and each fault the fill path meets (cut bodies, wrong checksums, 503 SlowDown, a
stalled store, a full disk, cancellation). No mocks: every failure crossed a socket."""

from __future__ import annotations

import asyncio
import gc
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import AioSession
from botocore.exceptions import ClientError

from cached.errors import FetchError, FetchTimeout, ObjectNotFound, VerifyError
from cached.stores import native
from cached.stores import s3_native as s3mod
from cached.stores.base import ObjectChanged, ObjectInfo, Opened, Sink
from cached.stores.retry import CONNECTION, CORRUPT, SERVER_ERROR, THROTTLED, TIMEOUT
from cached.stores.s3 import S3Source
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_disk import small_disk
from tests.test_sources import MID, PART, SMALL, payload, s3cfg, settles

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
        assert src.fetches_natively, "the native path was not taken"
        return src

    async def __aexit__(self, *exc: object) -> None:
        await self.source.__aexit__(None, None, None)


async def nothing(run: Sequence[bytes]) -> None:
    raise AssertionError("the native path handed bytes to the sink")


async def into_file(
    src: S3Source, info: ObjectInfo, sink: Sink, path: Path, opened: Opened | None = None
) -> bool:
    """Into ``path`` where the source writes files itself (True), else into ``sink``."""
    if await src.fetches_to_file(info, opened):
        await src.fetch_to_file(info, path, opened=opened)
        return True
    await src.stream_to_sink(info, sink, opened=opened)
    return False


async def fetched(src: S3Source, info: ObjectInfo, path: Path) -> bytes:
    """Fetch ``info`` into ``path`` natively; the file's bytes."""
    assert await into_file(src, info, nothing, path) is True
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
    # One GET per part of [s3] part_size (the CRT splits them; 8 MiB at most).
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
            assert await into_file(src, opened.info, sink, path, opened) is False
    assert b"".join(got) == body and not path.exists()
    assert s3_server.count("GET", bucket) == 1


async def test_an_open_holds_the_body_until_the_fetch_lets_it_come(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    # One request describes the object and brings it (D27), natively: nothing lands in
    # the file before the fetch lets it (the hot tier reserves room in between).
    body = payload(MID)
    s3_server.put(bucket, "obj.tar", body)
    landing, path = tmp_path / "open.partial", tmp_path / "obj.tar.partial"
    async with Native(proxy.endpoint_url, aio_session) as src:
        url = f"s3://{bucket}/obj.tar"
        async with await src.open(url, landing) as opened:
            described = await src.head(url)
            assert opened.info.size == MID and opened.info.version == described.version
            await asyncio.sleep(0.3)
            assert landing.stat().st_size == 0  # held at the headers
            assert await into_file(src, opened.info, nothing, path, opened) is True
    assert await asyncio.to_thread(path.read_bytes) == body and not landing.exists()
    assert len(proxy.requests("GET")) == -(-MID // PART)  # the parts of one GET, no more
    assert len(proxy.requests("HEAD")) == 1  # the test's own


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupted"])
async def test_an_open_checks_the_stores_checksum_not_the_md5_where_it_keeps_one(
    *,
    proxy: FaultProxy,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    corrupt: bool,
) -> None:
    """A single-part object's ETag is its MD5 (1.4 ms of CPU per MB); with [s3]
    checksum_head, where the store keeps a CRC64NVME (0.05 ms), the open's HEAD brings it
    while the body comes, and the file is checked with it: a corrupted body is caught by
    it and fetched again whole."""
    if not s3_server.keeps_checksums:
        pytest.skip("this store keeps no checksums (RGW 16.2): the MD5 checks the bytes")
    md5s: list[Path] = []
    md5_of_file = s3mod._md5_of_file
    monkeypatch.setattr(s3mod, "_md5_of_file", lambda p: md5s.append(p) or md5_of_file(p))
    body = payload(SMALL)
    s3_server.put(bucket, "obj.tar", body, checksum="CRC64NVME")
    client = Native(proxy.endpoint_url, aio_session, checksum_head=True)
    async with client as src:
        url = f"s3://{bucket}/obj.tar"
        if corrupt:  # the open's GET
            proxy.inject("corrupt", offset=1234)
        async with await src.open(url, tmp_path / "open") as opened:
            assert re.fullmatch("[0-9a-f]{32}", opened.info.etag or "")  # an MD5
            path = tmp_path / "obj"
            assert await into_file(src, opened.info, nothing, path, opened) is True
    assert await asyncio.to_thread(path.read_bytes) == body
    assert md5s == []
    assert len(proxy.requests("HEAD")) == 1
    assert client.reasons == ([CORRUPT] if corrupt else [])


async def test_a_store_that_keeps_no_checksums_is_asked_a_few_times_then_the_md5_checks(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    """With [s3] checksum_head, objects with no checksum (RGW 16.2 keeps none; older tools
    upload none): after CHECKSUM_PROBES HEADs that found none, opens ask no more, and the
    MD5 checks each."""
    body = payload(SMALL)
    opens = s3mod.CHECKSUM_PROBES + 3
    for i in range(opens):
        s3_server.put(bucket, f"{i}.tar", body, checksum=None)
    client = Native(proxy.endpoint_url, aio_session, checksum_head=True)
    async with client as src:
        for i in range(opens):
            async with await src.open(f"s3://{bucket}/{i}.tar", tmp_path / "open") as opened:
                path = tmp_path / f"{i}"
                if i == opens - 1:
                    proxy.inject("corrupt", offset=99)  # the retry's GET: the MD5 catches it
                    opened.close()  # the open's body unread: the fetch asks again
                assert await into_file(src, opened.info, nothing, path, opened)
            assert await asyncio.to_thread(path.read_bytes) == body
    assert len(proxy.requests("HEAD")) == s3mod.CHECKSUM_PROBES
    assert client.reasons == [CORRUPT]


async def test_opens_at_once_ask_no_more_checksum_probes_than_opens_one_at_a_time(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    """Opens at once, with [s3] checksum_head, of objects with no checksum: the probe
    HEADs are capped in flight too, not only once CHECKSUM_PROBES have found none, so a
    cold start of many opens asks CHECKSUM_PROBES HEADs, not one per open. Each HEAD
    answers 1 s late: every open asks (or not) before any probe has come back."""
    body = payload(SMALL)
    opens = s3mod.CHECKSUM_PROBES + 4
    for i in range(opens):
        s3_server.put(bucket, f"{i}.tar", body, checksum=None)
    proxy.inject("delay", method="HEAD", times=opens, delay_s=1.0)
    client = Native(proxy.endpoint_url, aio_session, checksum_head=True)

    async def read(src: S3Source, i: int) -> bytes:
        async with await src.open(f"s3://{bucket}/{i}.tar", tmp_path / f"open{i}") as opened:
            assert await into_file(src, opened.info, nothing, tmp_path / f"{i}", opened)
        return await asyncio.to_thread((tmp_path / f"{i}").read_bytes)

    async with client as src:
        got = await asyncio.gather(*(read(src, i) for i in range(opens)))
    assert got == [body] * opens
    assert len(proxy.requests("HEAD")) == s3mod.CHECKSUM_PROBES
    assert client.reasons == []


def put_multipart(s3_server: S3Server, bucket: str, key: str, body: bytes) -> None:
    """An object uploaded in two parts with a full-object CRC64NVME (as current SDKs do
    on S3): its ETag is no MD5."""
    client, half = s3_server.client, 5 << 20  # S3's smallest part but the last
    up = client.create_multipart_upload(
        Bucket=bucket, Key=key, ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT"
    )
    parts = []
    for number, chunk in ((1, body[:half]), (2, body[half:])):
        done = client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=up["UploadId"],
            PartNumber=number,
            Body=chunk,
            ChecksumAlgorithm="CRC64NVME",
        )
        parts.append(
            {
                "ETag": done["ETag"],
                "PartNumber": number,
                "ChecksumCRC64NVME": done["ChecksumCRC64NVME"],
            }
        )
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
    )


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupted"])
async def test_an_open_of_a_multipart_object_checks_the_stores_checksum(
    *,
    proxy: FaultProxy,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    corrupt: bool,
) -> None:
    # The open's GET is ranged (the CRT's first part) and brings no full-object checksum;
    # the ETag is no MD5: a HEAD asks for the checksum while the body comes, and the file
    # is checked with it (a corrupted body is caught, and fetched again whole).
    if not s3_server.keeps_checksums:
        pytest.skip("this store keeps no checksums (RGW 16.2): the size check alone")
    body = payload((5 << 20) + 1000)
    put_multipart(s3_server, bucket, "obj.tar", body)
    client = Native(proxy.endpoint_url, aio_session, part_size_bytes=8 << 20)
    async with client as src:
        url = f"s3://{bucket}/obj.tar"
        if corrupt:  # the open's GET (its one part comes before the headers)
            proxy.inject("corrupt", offset=12345)
        async with await src.open(url, tmp_path / "open") as opened:
            path = tmp_path / "obj"
            assert await into_file(src, opened.info, nothing, path, opened) is True
    assert await asyncio.to_thread(path.read_bytes) == body
    assert len(proxy.requests("HEAD")) == 1
    assert client.reasons == ([CORRUPT] if corrupt else [])


async def test_an_open_not_fetched_leaves_no_file_and_ends_its_request(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    s3_server.put(bucket, "obj.tar", payload(MID))
    landing = tmp_path / "open.partial"
    async with Native(proxy.endpoint_url, aio_session) as src:
        async with await src.open(f"s3://{bucket}/obj.tar", landing) as opened:
            assert opened.info.size == MID
        assert not landing.exists()
        # The CRT drops the held connection.
        assert await asyncio.to_thread(settles, lambda: proxy.in_flight == 0)
        gone = f"s3://{bucket}/gone.tar"
        with pytest.raises(ObjectNotFound):
            await src.open(gone, tmp_path / "gone.partial")
    assert not (tmp_path / "gone.partial").exists()
    assert len(proxy.requests("GET")) == 2
    # The 404's own GET says so: no HEAD after it (a cold tier asks next, D42).
    assert proxy.requests("HEAD") == []


async def test_a_dropped_body_leaves_no_error_in_the_log(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    """A held body that is not wanted ends its CRT request with an error of its own making;
    nobody awaits that end, and asyncio must not report it ("Future exception was never
    retrieved", an ERROR with a traceback in the daemon's log) once the request is gone."""
    s3_server.put(bucket, "obj.tar", payload(MID))
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        async with Native(proxy.endpoint_url, aio_session) as src:
            for n in range(3):
                async with await src.open(f"s3://{bucket}/obj.tar", tmp_path / f"{n}.partial"):
                    pass  # not fetched: the body is dropped
                # The CRT ends the request.
                assert await asyncio.to_thread(settles, lambda: proxy.in_flight == 0)
        await asyncio.sleep(0.2)  # the requests' ends reach the loop
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert [c.get("message") for c in reported] == []


@pytest.mark.parametrize("fault", ["cut", "corrupt"])
@pytest.mark.parametrize("when", ["before-headers", "after-headers"])
async def test_an_open_whose_get_fails_is_asked_again(
    *,
    proxy: FaultProxy,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    fault: str,
    when: str,
) -> None:
    # The CRT gives the headers once the first part is in (in memory): a failure in it
    # fails the open, which is asked again; one in a later part fails the fetch, whose
    # new GET names the version the open found.
    body = payload(MID)
    s3_server.put(bucket, "obj.tar", body)
    client = Native(proxy.endpoint_url, aio_session, part_concurrency=1)
    async with client as src:
        if when == "before-headers":
            proxy.inject(fault, after_bytes=1000, offset=500)
        async with await src.open(f"s3://{bucket}/obj.tar", tmp_path / "open") as opened:
            if when == "after-headers":
                proxy.inject(fault, after_bytes=1000, offset=500)  # a later part's GET
            path = tmp_path / "obj"
            assert await into_file(src, opened.info, nothing, path, opened) is True
    assert await asyncio.to_thread(path.read_bytes) == body
    assert client.reasons == [CONNECTION if fault == "cut" else CORRUPT]
    gets = proxy.requests("GET")
    failed = next(i for i, seen in enumerate(gets) if seen.fault)
    if when == "after-headers" or fault == "corrupt":  # MD5: found once the body is in
        # A new GET of the whole object, naming the version the open found.
        etag = f'"{opened.info.etag}"'
        assert any(g.range == f"bytes=0-{PART - 1}" and g.if_match == etag for g in gets[failed:])
    else:
        assert gets[failed + 1].if_match is None  # the open, asked again


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


@pytest.mark.parametrize(("budget", "gets"), [(0.0, 2), (1000.0, 1)], ids=["open", "budget"])
async def test_a_request_budget_takes_parts_of_part_size_above_the_crts_own(
    *,
    proxy: FaultProxy,
    s3_server: S3Server,
    bucket: str,
    aio_session: Any,
    tmp_path: Path,
    budget: float,
    gets: int,
) -> None:
    # 12 MiB with [s3] part_size 16 MiB: the CRT's 8 MiB cap makes it two GETs; with the
    # store's requests budgeted, requests are what is scarce, and it is one.
    body = payload(12 << 20)
    s3_server.put(bucket, "big.tar", body)
    client = Native(
        proxy.endpoint_url, aio_session, part_size_bytes=16 << 20, max_requests_per_s=budget
    )
    async with client as src:
        info = await src.head(f"s3://{bucket}/big.tar")
        assert await fetched(src, info, tmp_path / "big") == body
        assert src.pacer.requests == 1 + gets  # the HEAD, and each GET
    assert len(proxy.requests("GET")) == gets


async def test_throttling_past_the_budget_fails_the_fetch(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    s3_server.put(bucket, "obj.tar", payload(SMALL))
    client = Native(proxy.endpoint_url, aio_session, retry_attempts=3)
    async with client as src:
        info = await src.head(f"s3://{bucket}/obj.tar")
        proxy.inject("slowdown", times=20)
        # The request budget slows down first (cached/stores/pacing.py); once at its
        # floor, SlowDowns count against the 3 attempts, and the fetch fails.
        with pytest.raises(FetchError, match=r"gave up after \d+ attempt\(s\).*SlowDown"):
            await fetched(src, info, tmp_path / "obj")
    assert len(client.reasons) >= 2 and set(client.reasons) == {THROTTLED}
    assert src.pacer.decreases >= 2 and src.pacer.rate == 1.0  # at its floor


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
        task = asyncio.create_task(into_file(src, info, nothing, path))
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


async def test_a_kms_etag_is_not_taken_for_an_md5(
    proxy: FaultProxy, s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    # As on the botocore path: an SSE-KMS object's ETag is no MD5 on S3, so the native GET's
    # headers (x-amz-server-side-encryption) turn the MD5 off. moto's ETag is the MD5 all
    # the same, so a corrupted byte shows it was skipped.
    body = payload(SMALL)
    s3_server.put(bucket, "kms.tar", body, checksum=None, ServerSideEncryption="aws:kms")
    async with Native(proxy.endpoint_url, aio_session) as src:
        info = await src.head(f"s3://{bucket}/kms.tar")
        proxy.inject("corrupt", offset=5)
        got = await fetched(src, info, tmp_path / "kms")
    assert len(got) == len(body) and got != body


async def test_a_closed_client_lets_go_of_its_threads_and_sockets(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """After a GET and an open dropped unread, close() frees the client: the CRT's
    requests held it (through their callbacks, from native code the garbage collector
    does not see), and with it its event-loop threads and connections, for the life of
    the process (a test run of many daemons ran out of descriptors)."""
    import gc
    import weakref

    s3_server.put(bucket, "obj.tar", payload(MID))

    async def credentials() -> tuple[str, str, str | None]:
        return ("testing", "testing", None)

    client = native.NativeClient(s3cfg(s3_server.endpoint_url), s3_server.endpoint_url, credentials)
    await client.get(bucket, "obj.tar", tmp_path / "got", size=MID, etag=None, checksum=None)
    held = await client.open(bucket, "obj.tar", tmp_path / "held")
    held.abort()
    gone = weakref.ref(client)
    client.close()
    del client, held
    for _ in range(100):  # the dropped request ends on a CRT thread, a moment later
        gc.collect()
        if gone() is None:
            break
        await asyncio.sleep(0.05)
    assert gone() is None
    assert not (tmp_path / "held").exists()


async def test_each_get_is_signed_with_the_credentials_given_for_it(
    rgw_server: S3Server, tmp_path: Path
) -> None:
    """The CRT signs each GET with the credentials the daemon's chain gives before it (in
    C, with no call back into Python per part): rotated credentials are used from the
    next GET on, and a wrong secret is refused by RGW, which checks signatures."""
    bucket = rgw_server.new_bucket("signed-with-the-credentials-given")
    rgw_server.put(bucket, "obj.tar", payload(MID))
    secret = ["testing"]

    async def credentials() -> tuple[str, str, str | None]:
        return ("testing", secret[0], None)

    endpoint = rgw_server.endpoint_url
    client = native.NativeClient(s3cfg(endpoint), endpoint, credentials)
    try:
        await client.get(bucket, "obj.tar", tmp_path / "a", size=MID, etag=None, checksum=None)
        assert (tmp_path / "a").read_bytes() == payload(MID)
        secret[0] = "not-the-secret"
        with pytest.raises(ClientError) as refused:
            await client.get(bucket, "obj.tar", tmp_path / "b", size=MID, etag=None, checksum=None)
        assert refused.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
        secret[0] = "testing"
        await client.get(bucket, "obj.tar", tmp_path / "c", size=MID, etag=None, checksum=None)
        assert (tmp_path / "c").read_bytes() == payload(MID)
    finally:
        client.close()
