"""The cold tier: TierChain (warm -> cold), archived objects, promotion, ``[cold]`` config.

Against moto's real S3 server (and the fault proxy in front of it, as "another
endpoint") and real files; requests are counted at the server. No mocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import AioSession
from cached_wire.protocol import ErrorCode

from cached.config import ColdConfig, S3Config, load
from cached.errors import ConfigError, FetchError, ObjectArchived, ObjectNotFound
from cached.stores.base import ObjectInfo
from cached.stores.chain import TierChain
from cached.stores.s3 import S3Source
from cached.stores.s3_client import _archive_state, _archived
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_sources import Collect, payload
from tests.test_sources import s3cfg as source_s3cfg

PART = 64 * 1024
SMALL = 50_000  # below one part: one GET, one PUT
MID = 4 * PART + 7  # several ranged GETs; still one PUT is not allowed: above part_size
MULTI = (5 << 20) + 7  # S3's 5 MiB part floor: a two-part upload (5 MiB + 7 bytes)


def s3cfg(endpoint: str, **overrides: Any) -> S3Config:
    """The source tests' small parts and quick retries, with more patience for uploads."""
    return source_s3cfg(endpoint, **{"read_timeout_s": 5.0, "retry_attempts": 3, **overrides})


@pytest.fixture(scope="module")
def aio_session() -> Any:
    """One botocore session for the module: its parsed service models are reused."""
    return AioSession()


@pytest.fixture
def cold_bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A second fresh bucket: the cold tier."""
    return s3_server.new_bucket("cold-" + request.node.name)


ChainFactory = Callable[..., Any]


@pytest.fixture
def make_chain(s3_server: S3Server, aio_session: Any) -> ChainFactory:
    """``async with make_chain(cold_cfg, **s3_overrides) as tiers``."""

    @asynccontextmanager
    async def make(cold: ColdConfig | None = None, **overrides: Any) -> AsyncIterator[TierChain]:
        cfg = s3cfg(s3_server.endpoint_url, **overrides)
        async with TierChain(cfg, cold, session=aio_session) as chain:
            yield chain

    return make


def s3_cold(warm_bucket: str, cold_bucket: str, **overrides: Any) -> ColdConfig:
    return ColdConfig(
        warm_prefix=f"s3://{warm_bucket}/train/",
        cold_prefix=f"s3://{cold_bucket}/archive/2024/",
        **overrides,
    )


async def fetch_bytes(chain: TierChain, info: ObjectInfo) -> bytes:
    sink = Collect()
    await chain.stream_to_sink(info, sink)
    return sink.data


def object_bytes(s3_server: S3Server, bucket: str, key: str) -> bytes:
    body: bytes = s3_server.client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def exists(s3_server: S3Server, bucket: str, key: str) -> bool:
    listed = s3_server.client.list_objects_v2(Bucket=bucket, Prefix=key)
    return any(o["Key"] == key for o in listed.get("Contents", []))


# --- reading through the chain -------------------------------------------------------


@pytest.mark.stores
@pytest.mark.parametrize("size", [SMALL, MID], ids=["one-get", "ranged-gets"])
async def test_object_only_in_the_cold_bucket_is_served(
    s3_server: S3Server, bucket: str, cold_bucket: str, make_chain: ChainFactory, size: int
) -> None:
    body = payload(size)
    s3_server.put(cold_bucket, "archive/2024/a/shard-0.tar", body)
    url = f"s3://{bucket}/train/a/shard-0.tar"
    async with make_chain(s3_cold(bucket, cold_bucket)) as chain:
        info = await chain.head(url)
        assert info.tier == "cold"
        assert info.url == url
        assert info.source_url == f"s3://{cold_bucket}/archive/2024/a/shard-0.tar"
        assert info.read_url == info.source_url
        assert (info.size, info.endpoint) == (size, s3_server.endpoint_url)
        s3_server.reset_counts()
        assert await fetch_bytes(chain, info) == body
    # The bytes came from the cold bucket; the warm one was not read again.
    assert s3_server.count("GET", f"/{cold_bucket}/") >= 1
    assert s3_server.count("GET", f"/{bucket}/") == 0


@pytest.mark.parametrize("size", [SMALL, MID], ids=["one-get", "ranged-gets"])
async def test_open_finds_the_cold_copy_with_one_get_per_tier_and_no_head(
    s3_server: S3Server, bucket: str, cold_bucket: str, make_chain: ChainFactory, size: int
) -> None:
    body = payload(size)
    s3_server.put(cold_bucket, "archive/2024/o.tar", body)
    url = f"s3://{bucket}/train/o.tar"
    async with make_chain(s3_cold(bucket, cold_bucket)) as chain:
        described = await chain.head(url)
        s3_server.reset_counts()
        async with await chain.open(url) as opened:
            assert opened.info == described  # relabelled as head's answer: url, tier, source
            sink = Collect()
            await chain.stream_to_sink(opened.info, sink, opened=opened)
    assert sink.data == body
    # The warm miss was one GET (404); the cold copy's GET was the download's first.
    assert s3_server.count("GET", f"/{bucket}/") == 1
    assert s3_server.count("GET", f"/{cold_bucket}/") == -(-size // PART)
    assert s3_server.count("HEAD", "/") == 0


async def test_warm_hit_never_asks_the_cold_tier(
    s3_server: S3Server, bucket: str, cold_bucket: str, make_chain: ChainFactory
) -> None:
    warm, cold = payload(SMALL, 1), payload(SMALL, 2)
    s3_server.put(bucket, "train/s.tar", warm)
    s3_server.put(cold_bucket, "archive/2024/s.tar", cold)
    s3_server.reset_counts()
    async with make_chain(s3_cold(bucket, cold_bucket, promote=True)) as chain:
        info = await chain.head(f"s3://{bucket}/train/s.tar")
        assert (info.tier, info.source_url) == ("warm", None)
        assert not chain.promote_enabled(info)
        assert await fetch_bytes(chain, info) == warm
    assert s3_server.count("HEAD", f"/{cold_bucket}/") == 0
    assert s3_server.count("GET", f"/{cold_bucket}/") == 0


async def test_missing_in_both_tiers_names_both_urls(
    bucket: str, cold_bucket: str, make_chain: ChainFactory
) -> None:
    async with make_chain(s3_cold(bucket, cold_bucket)) as chain:
        with pytest.raises(ObjectNotFound) as caught:
            await chain.head(f"s3://{bucket}/train/nope.tar")
    message = str(caught.value)
    assert f"s3://{bucket}/train/nope.tar" in message
    assert f"s3://{cold_bucket}/archive/2024/nope.tar" in message
    assert not isinstance(caught.value, ObjectArchived)


async def test_urls_outside_warm_prefix_and_no_cold_tier_behave_like_sources(
    s3_server: S3Server, bucket: str, cold_bucket: str, make_chain: ChainFactory
) -> None:
    s3_server.put(cold_bucket, "archive/2024/x.tar", b"x")
    s3_server.put(cold_bucket, "other/x.tar", b"x")
    s3_server.reset_counts()
    async with make_chain(s3_cold(bucket, cold_bucket)) as chain:
        with pytest.raises(ObjectNotFound) as caught:
            await chain.head(f"s3://{bucket}/other/x.tar")  # not under warm_prefix
        assert str(caught.value).startswith(f"s3://{bucket}/other/x.tar: not found at")
    async with make_chain(None) as chain:  # no cold tier at all
        with pytest.raises(ObjectNotFound):
            await chain.head(f"s3://{bucket}/train/x.tar")
        with pytest.raises(FetchError, match="bad shard URL"):
            await chain.head("http://example.com/x.tar")
    assert s3_server.count("HEAD", f"/{cold_bucket}/") == 0


async def test_cold_tier_on_another_endpoint(
    s3_server: S3Server, bucket: str, cold_bucket: str, make_chain: ChainFactory
) -> None:
    # The fault proxy in front of the same server is, to the client, another endpoint.
    body = payload(SMALL, 3)
    s3_server.put(cold_bucket, "archive/2024/e.tar", body)
    with FaultProxy.start(s3_server.endpoint_url) as proxy:
        cold = s3_cold(bucket, cold_bucket, endpoint_url=proxy.endpoint_url, region="eu-west-1")
        async with make_chain(cold) as chain:
            info = await chain.head(f"s3://{bucket}/train/e.tar")
            assert (info.tier, info.endpoint) == ("cold", proxy.endpoint_url)
            assert await fetch_bytes(chain, info) == body
        assert [r.method for r in proxy.requests(None)] == ["HEAD", "GET"]


async def test_cold_tier_on_an_archive_path(
    s3_server: S3Server, bucket: str, make_chain: ChainFactory, tmp_path: Path
) -> None:
    body = payload(MID, 4)
    (tmp_path / "archive" / "a").mkdir(parents=True)
    (tmp_path / "archive" / "a" / "f.tar").write_bytes(body)
    cold = ColdConfig(
        warm_prefix=f"s3://{bucket}/", cold_prefix=(tmp_path / "archive").as_uri() + "/"
    )
    url = f"s3://{bucket}/a/f.tar"
    async with make_chain(cold) as chain:
        info = await chain.head(url)
        assert (info.tier, info.endpoint, info.url) == ("cold", "file://", url)
        assert info.source_url == (tmp_path / "archive" / "a" / "f.tar").as_uri()
        assert await fetch_bytes(chain, info) == body
        with pytest.raises(ObjectNotFound, match="no such file"):
            await chain.head(f"s3://{bucket}/a/missing.tar")


# --- archived objects ----------------------------------------------------------------
# moto only (not marked `stores`): RGW 16.2 has no archive storage classes nor restores
# to emulate them with; the reads and writes above and below run on both.


async def test_archived_object_without_cold_tier_says_what_to_do(
    s3_server: S3Server, bucket: str, make_chain: ChainFactory
) -> None:
    s3_server.client.put_object(Bucket=bucket, Key="g.tar", Body=b"g" * 10, StorageClass="GLACIER")
    url = f"s3://{bucket}/g.tar"
    async with make_chain(None) as chain:
        with pytest.raises(ObjectArchived) as caught:
            await chain.head(url)
        assert str(caught.value).startswith(f"{url} is archived (GLACIER) and not restored")
        assert "restore it" in str(caught.value) and "[cold]" in str(caught.value)
        assert isinstance(caught.value, ObjectNotFound)
        assert caught.value.code == ErrorCode.NOT_FOUND
        # Opened with a GET (a cold miss asks no HEAD first), it says the same: the 403
        # InvalidObjectState is followed by a HEAD, which tells a restore under way.
        with pytest.raises(ObjectArchived) as opened:
            await chain.open(url)
        assert str(opened.value) == str(caught.value)
        # A GET of it (an ObjectInfo from before it was archived) fails the same way: S3
        # answers 403 InvalidObjectState, which must not read as "access denied".
        stale = ObjectInfo(url=url, endpoint=s3_server.endpoint_url, size=10, version="v")
        with pytest.raises(ObjectArchived, match=r"is archived \(GLACIER\)"):
            await fetch_bytes(chain, stale)


async def test_restored_and_instant_retrieval_objects_are_readable(
    s3_server: S3Server, bucket: str, make_chain: ChainFactory
) -> None:
    client = s3_server.client
    client.put_object(Bucket=bucket, Key="ir.tar", Body=b"i" * 10, StorageClass="GLACIER_IR")
    client.put_object(Bucket=bucket, Key="deep.tar", Body=b"d" * 10, StorageClass="DEEP_ARCHIVE")
    client.restore_object(Bucket=bucket, Key="deep.tar", RestoreRequest={"Days": 1})
    async with make_chain(None) as chain:
        for key, byte in (("ir.tar", b"i"), ("deep.tar", b"d")):
            info = await chain.head(f"s3://{bucket}/{key}")
            assert await fetch_bytes(chain, info) == byte * 10


def test_archive_states_moto_cannot_produce() -> None:
    # A restore under way, and Intelligent-Tiering's archive tiers: moto restores at once
    # and has no archive tiers, so these HEAD answers are written out as S3 sends them.
    ongoing = {"StorageClass": "GLACIER", "Restore": 'ongoing-request="true"'}
    assert _archive_state(ongoing) == "GLACIER"
    assert "a restore is in progress" in str(_archived("s3://b/k", "GLACIER", ongoing["Restore"]))
    tiered = {"StorageClass": "INTELLIGENT_TIERING", "ArchiveStatus": "DEEP_ARCHIVE_ACCESS"}
    assert _archive_state(tiered) == "DEEP_ARCHIVE_ACCESS"
    assert _archive_state({"StorageClass": "INTELLIGENT_TIERING"}) is None
    assert _archive_state({"StorageClass": "STANDARD"}) is None
    assert _archive_state({}) is None


async def test_archived_warm_object_is_read_from_the_cold_tier(
    s3_server: S3Server, bucket: str, cold_bucket: str, make_chain: ChainFactory
) -> None:
    body = payload(SMALL, 5)
    s3_server.client.put_object(
        Bucket=bucket, Key="train/g.tar", Body=b"old", StorageClass="DEEP_ARCHIVE"
    )
    s3_server.put(cold_bucket, "archive/2024/g.tar", body)
    async with make_chain(s3_cold(bucket, cold_bucket)) as chain:
        info = await chain.head(f"s3://{bucket}/train/g.tar")
        assert info.tier == "cold"
        assert await fetch_bytes(chain, info) == body


async def test_archived_in_both_tiers_is_archived(
    s3_server: S3Server, bucket: str, cold_bucket: str, make_chain: ChainFactory
) -> None:
    s3_server.client.put_object(
        Bucket=cold_bucket, Key="archive/2024/g.tar", Body=b"g", StorageClass="GLACIER"
    )
    async with make_chain(s3_cold(bucket, cold_bucket)) as chain:
        with pytest.raises(ObjectArchived, match=f"s3://{cold_bucket}/archive/2024/g.tar"):
            await chain.head(f"s3://{bucket}/train/g.tar")


# --- promotion -----------------------------------------------------------------------


async def promote_from_cold(chain: TierChain, url: str, tmp_path: Path) -> tuple[ObjectInfo, bytes]:
    """What the daemon does on a cold hit: fetch into a local file, then promote it."""
    info = await chain.head(url)
    assert info.tier == "cold" and chain.promote_enabled(info)
    data = await fetch_bytes(chain, info)
    shard = tmp_path / "shard.tar"
    shard.write_bytes(data)
    await chain.promote(info, shard)
    return info, data


@pytest.mark.stores
@pytest.mark.parametrize(
    "size_parts", [(SMALL, 0), (MID, 1), (MULTI, 2)], ids=["put", "one-part", "two-parts"]
)
async def test_promotion_writes_the_shard_to_the_warm_bucket(
    s3_server: S3Server,
    bucket: str,
    make_chain: ChainFactory,
    tmp_path: Path,
    size_parts: tuple[int, int],
) -> None:
    size, parts = size_parts  # parts: 0 for a single PUT
    cold_bucket = s3_server.new_bucket("cold-promotion")
    body = payload(size, 6)
    s3_server.put(cold_bucket, "archive/2024/p.tar", body)
    url = f"s3://{bucket}/train/p.tar"
    async with make_chain(s3_cold(bucket, cold_bucket, promote=True)) as chain:
        await promote_from_cold(chain, url, tmp_path)
        assert object_bytes(s3_server, bucket, "train/p.tar") == body
        # The next lookup (this node after a restart, or another node) is a warm hit.
        again = await chain.head(url)
        assert (again.tier, again.size, again.source_url) == ("warm", size, None)
        assert await fetch_bytes(chain, again) == body
    etag = s3_server.client.head_object(Bucket=bucket, Key="train/p.tar")["ETag"]
    assert etag.strip('"').endswith(f"-{parts}") if parts else "-" not in etag
    assert not s3_server.client.list_multipart_uploads(Bucket=bucket).get("Uploads")


@pytest.mark.stores
@pytest.mark.parametrize("size", [9, MID], ids=["put", "multipart"])
async def test_promotion_never_overwrites_an_object_that_appeared(
    *,
    s3_server: S3Server,
    bucket: str,
    cold_bucket: str,
    make_chain: ChainFactory,
    tmp_path: Path,
    size: int,
) -> None:
    # Multipart: RGW 16.2 ignores If-None-Match on the completion; S3Source.put checks
    # with a HEAD before completing.
    s3_server.put(cold_bucket, "archive/2024/r.tar", payload(size, 5))
    url = f"s3://{bucket}/train/r.tar"
    async with make_chain(s3_cold(bucket, cold_bucket, promote=True)) as chain:
        info = await chain.head(url)
        # Another node promoted (or someone wrote) the shard after our miss.
        s3_server.put(bucket, "train/r.tar", b"newer warm copy")
        shard = tmp_path / "r.tar"
        shard.write_bytes(await fetch_bytes(chain, info))
        await chain.promote(info, shard)
    assert object_bytes(s3_server, bucket, "train/r.tar") == b"newer warm copy"


async def test_promotion_is_off_unless_configured(
    s3_server: S3Server, bucket: str, cold_bucket: str, make_chain: ChainFactory, tmp_path: Path
) -> None:
    s3_server.put(cold_bucket, "archive/2024/o.tar", b"o")
    async with make_chain(s3_cold(bucket, cold_bucket)) as chain:
        info = await chain.head(f"s3://{bucket}/train/o.tar")
        assert info.tier == "cold" and not chain.promote_enabled(info)
        shard = tmp_path / "o.tar"
        shard.write_bytes(b"o")
        with pytest.raises(ValueError, match="promotion is off"):
            await chain.promote(info, shard)
    assert not exists(s3_server, bucket, "train/o.tar")


async def test_promotion_from_an_archive_path(
    s3_server: S3Server, bucket: str, make_chain: ChainFactory, tmp_path: Path
) -> None:
    body = payload(SMALL, 7)
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "f.tar").write_bytes(body)
    cold = ColdConfig(
        warm_prefix=f"s3://{bucket}/",
        cold_prefix=(tmp_path / "archive").as_uri() + "/",
        promote=True,
    )
    async with make_chain(cold) as chain:
        await promote_from_cold(chain, f"s3://{bucket}/f.tar", tmp_path)
    assert object_bytes(s3_server, bucket, "f.tar") == body


# --- S3Source.put on its own ---------------------------------------------------------


@pytest.mark.stores
async def test_put_retries_a_failed_part(
    s3_server: S3Server, bucket: str, proxy: FaultProxy, aio_session: Any, tmp_path: Path
) -> None:
    body = payload(MID, 8)
    path = tmp_path / "m.tar"
    path.write_bytes(body)
    proxy.inject("error", status=500, method="PUT")
    async with S3Source(s3cfg(proxy.endpoint_url), session=aio_session) as src:
        assert src.upload_part_size(MID) == 5 << 20
        assert src.upload_part_size(100 << 30) == -(-(100 << 30) // 10_000)  # 10,000 parts
        await src.put(f"s3://{bucket}/m.tar", path, MID)
    assert object_bytes(s3_server, bucket, "m.tar") == body
    assert [r.fault for r in proxy.requests("PUT")] == ["error", None]
    assert s3_server.client.head_object(Bucket=bucket, Key="m.tar")["ETag"].endswith('-1"')


@pytest.mark.stores
async def test_failed_multipart_upload_is_aborted(
    s3_server: S3Server, bucket: str, proxy: FaultProxy, aio_session: Any, tmp_path: Path
) -> None:
    path = tmp_path / "m.tar"
    path.write_bytes(payload(MID, 9))
    proxy.inject("error", status=403, method="PUT")  # the part: a 403 is not retried
    async with S3Source(s3cfg(proxy.endpoint_url), session=aio_session) as src:
        with pytest.raises(FetchError, match="access denied"):
            await src.put(f"s3://{bucket}/m.tar", path, MID)
    assert [r.method for r in proxy.requests("DELETE")] == ["DELETE"]
    assert not s3_server.client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert not exists(s3_server, bucket, "m.tar")


@pytest.mark.stores
async def test_put_checks_the_file_size(
    s3_server: S3Server, bucket: str, aio_session: Any, tmp_path: Path
) -> None:
    path = tmp_path / "s.tar"
    path.write_bytes(b"12345")
    async with S3Source(s3cfg(s3_server.endpoint_url), session=aio_session) as src:
        with pytest.raises(FetchError, match="expected 6 bytes"):
            await src.put(f"s3://{bucket}/s.tar", path, 6)
        await src.put(f"s3://{bucket}/s.tar", path, 5)
        # Unconditional by default: a second put replaces the object.
        path.write_bytes(b"54321")
        await src.put(f"s3://{bucket}/s.tar", path, 5)
    assert object_bytes(s3_server, bucket, "s.tar") == b"54321"


# --- [cold] configuration ------------------------------------------------------------


def test_cold_config_loads_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[cold]\nwarm_prefix = "s3://data/train/"\ncold_prefix = "s3://archive/train/"\n'
        'endpoint_url = "http://archive:9000"\nregion = "eu-west-1"\n'
    )
    cfg = load(path, env={"CACHED_COLD_PROMOTE": "true"})
    assert cfg.cold == ColdConfig(
        "s3://data/train/", "s3://archive/train/", "http://archive:9000", "eu-west-1", True
    )
    assert cfg.cold.enabled
    assert cfg.cold.cold_url("s3://data/train/a/b.tar") == "s3://archive/train/a/b.tar"
    assert cfg.cold.cold_url("s3://data/val/a.tar") is None
    default = load(None, env={}).cold
    assert default == ColdConfig() and not default.enabled and default.cold_url("s3://a/b") is None


def test_example_config_has_the_cold_defaults() -> None:
    example = load(Path(__file__).parent.parent / "config.example.toml", env={})
    assert example.cold == ColdConfig()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('warm_prefix = "s3://a/"', r"\[cold\] cold_prefix is not set"),
        ('cold_prefix = "s3://a/"', r"\[cold\] warm_prefix is not set"),
        ("promote = true", r"\[cold\] promote needs a cold tier"),
        ('warm_prefix = "http://a/"\ncold_prefix = "s3://b/"', r"\[cold\] warm_prefix must start"),
        ('warm_prefix = "s3://a/"\ncold_prefix = "gs://b/"', r"\[cold\] cold_prefix must start"),
        ('warm_prefix = "s3://a/"\ncold_prefix = "file://rel/"', r"cold_prefix must start"),
        ('warm_prefix = "s3://a/x/"\ncold_prefix = "s3://b/y"', r"both end with '/' or neither"),
        ('warm_prefix = "s3://a/"\ncold_prefix = "s3://a/"', r"cold_prefix is warm_prefix"),
        (
            'warm_prefix = "s3://a/"\ncold_prefix = "file:///mnt/archive/"\nendpoint_url = "http://x"',
            r"endpoint_url applies to an s3:// cold_prefix only",
        ),
        (
            'warm_prefix = "file:///data/"\ncold_prefix = "s3://b/"\npromote = true',
            r"warm_prefix\s+must be an s3:// prefix",
        ),
        ('warm_prefix = "s3://a/"\ncold_prefix = "s3://b/"\npromote = "yes"', "not a boolean"),
        ("warm_prefixx = 1", r"unknown key \[cold\] 'warm_prefixx'"),
    ],
)
def test_bad_cold_config_names_file_and_key(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[cold]\n{table}\n")
    with pytest.raises(ConfigError, match=message) as caught:
        load(path, env={})
    assert str(caught.value).startswith(str(path))


def test_cold_config_accepts_the_shapes_it_documents(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    for warm, cold, extra in (
        ("s3://data/", "file:///mnt/archive/", ""),
        ("s3://data/train-", "s3://data/archive/train-", "promote = true"),  # same bucket
        ("s3://data/", "s3://data/", 'endpoint_url = "http://archive:9000"'),  # same names
        ("file:///data/", "file:///mnt/archive/", ""),
    ):
        path.write_text(f'[cold]\nwarm_prefix = "{warm}"\ncold_prefix = "{cold}"\n{extra}\n')
        assert load(path, env={}).cold.enabled
