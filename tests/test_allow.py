"""``[server] allow``: which URLs a client may ask for (cached/access.py). By default every
``s3://`` URL and no ``file://`` one; a refusal is ``forbidden`` (``Forbidden`` in the
client) and says the same whether the path exists or not."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from cached_client import CachedDataset
from cached_client.errors import CachedClientError, Forbidden, ShardNotFound
from cached_client.transport import Connection
from cached_wire.protocol import ErrorCode

from cached.access import Access
from cached.access import Forbidden as DaemonForbidden
from cached.config import load
from cached.errors import ConfigError
from tests.daemon import daemon_config, make_tar, thread_daemon
from tests.s3server import S3Server


def shard(path: Path, key: str = "k") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(make_tar([(key, {"txt": b"secret" if "outside" in str(path) else b"ok"})]))
    return path.as_uri()


def refusal(conn: Connection, url: str) -> Forbidden:
    with pytest.raises(Forbidden) as info:
        conn.request({"op": "open", "url": url, "stream": "s"})
    assert info.value.code == ErrorCode.FORBIDDEN
    assert isinstance(info.value, CachedClientError) and isinstance(info.value, PermissionError)
    return info.value


def test_by_default_no_file_url_is_served_and_existence_is_not_revealed(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    existing = shard(tmp_path / "outside" / "real.tar")
    missing = (tmp_path / "outside" / "none.tar").as_uri()
    s3_server.put(bucket, "a.tar", make_tar([("k", {"txt": b"ok"})]))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        one, other = refusal(conn, existing), refusal(conn, missing)
        assert str(one).replace(existing, "URL") == str(other).replace(missing, "URL")
        assert "[server] allow" in str(one) and "s3://" in str(one)
        # Every op that names a URL, and a plan that names one among others.
        for op in ("read", "close"):
            with pytest.raises(Forbidden):
                conn.request({"op": op, "url": existing, "stream": "s", "start": 0, "count": 1})
        # A pin given back with another request ("release") names a URL too.
        with pytest.raises(Forbidden):
            conn.request({"op": "open", "url": f"s3://{bucket}/a.tar", "release": [existing]})
        plan = {"op": "plan", "plan": "p", "urls": [f"s3://{bucket}/a.tar", existing]}
        with pytest.raises(Forbidden, match=r"real\.tar is not allowed"):
            conn.request(plan)
        # S3 is allowed by default, and the daemon keeps serving.
        assert [s["txt"] for s in CachedDataset(f"s3://{bucket}/a.tar", socket=d.socket)] == [b"ok"]
        assert d.call(d.daemon.status)["hot"]["shards"] == 1  # nothing of the file's


def test_an_allowed_directory_and_the_ways_out_of_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    inside = shard(data / "train" / "a.tar")
    outside = shard(tmp_path / "outside" / "real.tar")
    (data / "escape").symlink_to(tmp_path / "outside")  # a link out of the directory
    (data / "file-link.tar").symlink_to(tmp_path / "outside" / "real.tar")
    (tmp_path / "link-in").symlink_to(data / "train")  # a link into it, from outside
    cfg = daemon_config(tmp_path, None, **{"server.allow": ["s3://", f"{data.as_uri()}/"]})
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        assert [s["txt"] for s in CachedDataset(inside, socket=d.socket)] == [b"ok"]
        # A missing file inside the directory is an ordinary miss.
        with pytest.raises(ShardNotFound):
            conn.request({"op": "open", "url": f"{data.as_uri()}/none.tar", "stream": "s"})
        for url in (
            outside,
            f"{data.as_uri()}/../outside/real.tar",  # dots
            f"{data.as_uri()}/%2e%2e/outside/real.tar",  # dots, percent-encoded
            f"{data.as_uri()}/train/../../outside/real.tar",
            f"file://localhost{data}/../outside/real.tar",
            f"{data.as_uri()}/escape/real.tar",  # a directory link pointing out
            f"{data.as_uri()}/file-link.tar",  # a file link pointing out
            f"{data.as_uri()}/escape/../escape/real.tar",
            f"{data.as_uri()}/a%00.tar",  # NUL
            (tmp_path / "link-in" / "a.tar").as_uri(),  # outside as written
            f"{data.as_uri()}",  # the directory itself, not under it
        ):
            refusal(conn, url)
        plan = {"op": "plan", "plan": "p", "urls": [inside, f"{data.as_uri()}/escape/real.tar"]}
        with pytest.raises(Forbidden):
            conn.request(plan)
        conn.request({"op": "plan", "plan": "p", "urls": [inside] * 100})
        assert d.call(d.daemon.status)["hot"]["shards"] == 1  # only the allowed shard


def test_an_s3_prefix_limits_buckets_and_keys(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    for key in ("train/a.tar", "other.tar"):
        s3_server.put(bucket, key, make_tar([("k", {"txt": b"x"})]))
    cfg = daemon_config(
        tmp_path, s3_server.endpoint_url, **{"server.allow": [f"s3://{bucket}/train/"]}
    )
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        assert conn.request({"op": "open", "url": f"s3://{bucket}/train/a.tar", "stream": "s"})
        for url in (
            f"s3://{bucket}/other.tar",
            f"s3://{bucket}/train/../other.tar",  # the HTTP layer would resolve the dots
            f"s3://{bucket}/train/%2E%2E/other.tar",
            f"s3://other-{bucket}/train/a.tar",
            (tmp_path / "x.tar").as_uri(),
        ):
            refusal(conn, url)
    # This test's other key and other bucket only: the server's counts are the session's,
    # and other tests' buckets are named after them ("another ...").
    mine = rf"{re.escape(bucket)}/.*other|other-{re.escape(bucket)}"
    assert s3_server.count("GET", mine) == 0


def test_an_allowed_directory_may_itself_be_a_link(tmp_path: Path) -> None:
    real = tmp_path / "nvme" / "data"
    shard(real / "a.tar")
    (tmp_path / "data").symlink_to(real)
    access = Access([f"{(tmp_path / 'data').as_uri()}/"])
    import asyncio

    asyncio.run(access.check([(tmp_path / "data" / "a.tar").as_uri()]))
    with pytest.raises(DaemonForbidden):
        # Outside as written, though the same file: the lexical form decides first.
        asyncio.run(access.check([(real / "a.tar").as_uri()]))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "allow is empty"),
        ("file:///data", "ending with /"),
        ("http://example.com/", "allow entries must be"),
        ("file://relative/", "allow entries must be"),
    ],
)
def test_bad_allow_lists_name_the_key(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(None, env={"CACHED_SERVER_ALLOW": value})


def test_allow_from_the_file_and_the_environment(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[server]\nallow = ["s3://b/", "file:///data/"]\n')
    assert load(toml, env={}).server.allow == ("s3://b/", "file:///data/")
    env = {"CACHED_SERVER_ALLOW": "s3://, file:///mnt/x/"}
    assert load(None, env=env).server.allow == ("s3://", "file:///mnt/x/")
    assert load(None, env={}).server.allow == ("s3://",)
    toml.write_text('[server]\nallow = "s3://"\n')
    with pytest.raises(ConfigError, match="not a list of strings"):
        load(toml, env={})


def test_a_requests_admission_is_remembered_briefly_and_a_refusal_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader names each shard in three or four requests within moments; the look at the
    # file system runs in a worker thread, so an admitted URL is admitted again without a
    # look for ADMITTED_S (D30). The trade-off, pinned here: a file swapped for a link out
    # of the directory is refused only once that has passed.
    import asyncio

    from cached import access as access_module

    monkeypatch.setattr(access_module, "ADMITTED_S", 0.3)
    data, outside = tmp_path / "data", tmp_path / "outside" / "real.tar"
    url, later = shard(data / "a.tar"), shard(data / "b.tar")
    shard(outside)
    access = Access([f"{data.as_uri()}/"])

    def swap(name: str) -> None:
        (data / name).unlink()
        (data / name).symlink_to(outside)

    def check(urls: list[str], remember: bool = True) -> None:
        # What the server does: a look only where the answer is not settled.
        if not access.settled(urls):
            asyncio.run(access.check(urls, remember=remember))

    assert not access.settled([url])
    check([url])
    assert access.settled([url])
    swap("a.tar")
    check([url])  # admitted moments ago: no look
    time.sleep(0.35)
    assert not access.settled([url])
    with pytest.raises(DaemonForbidden):
        check([url])
    with pytest.raises(DaemonForbidden):  # refusals are not remembered...
        check([url])
    (data / "a.tar").unlink()
    shard(data / "a.tar")
    check([url])  # ...so a repair counts at once
    # A plan's URLs are not remembered: the request that follows looks again.
    check([later] * 100, remember=False)
    swap("b.tar")
    with pytest.raises(DaemonForbidden):
        check([later])
