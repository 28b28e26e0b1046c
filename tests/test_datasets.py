"""Compact plans (issue 24, item 5; docs/protocol.md, "Datasets"): a dataset's URL list is
told once, plans name positions in it. Against a real daemon over real sockets: a plan by
positions is the plan its URLs would be; a name that is not the list's digest, a URL outside
``[server] allow``, a position past the list and an unknown dataset are refused, each with
its own code; a user's datasets count against the plan-URL caps; a dataset lapses only when
no plan names it; and a client whose dataset lapsed tells it again by itself."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cached_client import CachedDataset
from cached_client.errors import RemoteError
from cached_client.reader import announce
from cached_client.transport import Connection
from cached_wire.catalog import Catalog, catalog_id, decode_index, encode_index
from cached_wire.protocol import Op, encode

from bench.bounds_rss import storeless_daemon
from cached.datasets import key as dataset_key
from cached.owners import name_of
from tests.daemon import ProcessDaemon, daemon_config, thread_daemon
from tests.s3server import S3Server
from tests.test_tiering import equal_shards

# The user this test's connections are (the daemon holds their plans and datasets under it).
ME = f"uid {os.getuid()}"

URLS = [f"s3://b/shard-{i:04d}.tar" for i in range(200)]


def plans(d: Any) -> list[tuple[str, list[str], str]]:
    """Each installed plan: its key, its URLs and the dataset it named, as the client named
    them (the daemon holds them under the client's user)."""
    return d.call(
        lambda: [
            (name_of(p.key), list(p.urls), name_of(p.dataset)) for p in d.daemon.planner.plans()
        ]
    )


@contextmanager
def connected(tmp_path: Path, **values: Any) -> Iterator[tuple[Any, Connection]]:
    """A daemon that fetches nothing (no lookahead, no store) and a connection to it."""
    cfg = daemon_config(tmp_path, None, **{"prefetch.lookahead": "0", **values})
    with thread_daemon(cfg) as d:
        conn = Connection(d.socket)
        try:
            yield d, conn
        finally:
            conn.close()


def tell(conn: Connection, urls: list[str], name: str | None = None) -> None:
    conn.request({"op": Op.DATASET, "dataset": name or catalog_id(urls), "urls": urls})


def plan_by_index(conn: Connection, key: str, dataset: str, positions: list[int]) -> None:
    conn.request({"op": Op.PLAN, "plan": key, "dataset": dataset, "index": encode_index(positions)})


def test_the_index_and_the_name_round_trip_and_refuse_what_they_do_not_encode() -> None:
    positions = [0, 7, 2**32 - 1, 3, 3]
    assert list(decode_index(encode_index(positions))) == positions
    assert len(encode_index(range(3))) == 16  # 12 bytes, base64
    for bad in ("not base64!", "AAAA", "\u00e9"):  # 3 bytes: not whole positions
        with pytest.raises(ValueError):
            decode_index(bad)
    # Length-prefixed: where the URLs split changes the name.
    assert catalog_id(["s3://b/ab", "c"]) != catalog_id(["s3://b/a", "bc"])
    assert catalog_id(URLS) == catalog_id(list(URLS)) != catalog_id(URLS[::-1])
    catalog = Catalog(URLS)
    assert catalog.index(["s3://b/nowhere.tar"]) is None
    assert list(decode_index(catalog.index([URLS[5], URLS[0]]) or "")) == [5, 0]


def test_a_plan_by_positions_is_the_plan_of_its_urls_and_shares_their_strings(
    tmp_path: Path,
) -> None:
    with connected(tmp_path) as (d, conn):
        tell(conn, URLS)
        plan_by_index(conn, "empty", catalog_id(URLS), [])  # a reader with no shards
        assert plans(d) == [("empty", [], catalog_id(URLS))]
        order = [5, 3, 199, 0, 5]
        plan_by_index(conn, "p", catalog_id(URLS), order)
        assert plans(d)[1:] == [("p", [URLS[i] for i in order], catalog_id(URLS))]
        held = d.call(lambda: d.daemon.server.datasets.find(catalog_id(URLS), ME).urls)
        same = d.call(lambda: d.daemon.planner.plans()[1].urls[2] is held[199])
        assert same  # one copy of each URL's text, however many plans name it
        status = d.call(d.daemon.status)
        assert status["datasets"] == {"datasets": 1, "urls": 200}
        assert status["plans"][0]["dataset"] == catalog_id(URLS)


def test_bad_datasets_and_plans_are_refused_each_with_its_code(tmp_path: Path) -> None:
    with connected(tmp_path) as (d, conn):

        def refused(header: dict[str, Any]) -> RemoteError:
            with pytest.raises(RemoteError) as caught:
                conn.request(header)
            return caught.value

        name = catalog_id(URLS)
        unknown = refused({"op": Op.PLAN, "plan": "p", "dataset": name, "index": ""})
        assert unknown.code == "unknown_dataset" and "send it" in str(unknown)
        wrong = refused({"op": Op.DATASET, "dataset": name, "urls": URLS[:-1]})
        assert wrong.code == "bad_request" and "not the digest" in str(wrong)
        local = ["file:///etc/passwd"]
        forbidden = refused({"op": Op.DATASET, "dataset": catalog_id(local), "urls": local})
        assert forbidden.code == "forbidden"
        bad = ["s3://b/a.tar", 7]
        assert refused({"op": Op.DATASET, "dataset": name, "urls": bad}).code == "bad_request"
        tell(conn, URLS)
        past = refused({"op": Op.PLAN, "plan": "p", "dataset": name, "index": encode_index([200])})
        assert past.code == "bad_request" and "past dataset" in str(past)
        garbled = refused({"op": Op.PLAN, "plan": "p", "dataset": name, "index": "AAA"})
        assert garbled.code == "bad_request"
        assert plans(d) == []
        # A name held stands for the list checked when it was told, whatever is sent.
        tell(conn, ["s3://b/other.tar"], name=name)
        plan_by_index(conn, "p", name, [1])
        assert plans(d) == [("p", [URLS[1]], name)]


def test_a_plan_by_positions_names_at_most_max_plan_shards(tmp_path: Path) -> None:
    with connected(tmp_path) as (d, conn):
        server = d.daemon.server
        d.call(lambda: setattr(server.plans, "max_plan_shards", 4))
        with pytest.raises(RemoteError, match="a dataset may name at most 4 shards"):
            tell(conn, URLS)
        tell(conn, URLS[:4])
        with pytest.raises(RemoteError, match="a plan may name at most 4 shards"):
            plan_by_index(conn, "p", catalog_id(URLS[:4]), [0, 1, 2, 3, 0])
        plan_by_index(conn, "p", catalog_id(URLS[:4]), [0, 1, 2, 3])


def test_a_users_datasets_count_against_the_plan_url_caps(tmp_path: Path) -> None:
    with connected(tmp_path, **{"server.max_plan_urls_per_user": 300}) as (_, conn):
        tell(conn, URLS)
        tell(conn, URLS)  # told again: counted once
        with pytest.raises(RemoteError) as refused:
            tell(conn, URLS[:150])
        assert refused.value.code == "limit_exceeded"
        assert "max_plan_urls_per_user" in str(refused.value)
        tell(conn, URLS[:100])  # 300 in all: at the cap


def test_a_dataset_lapses_only_when_no_plan_names_it_and_the_client_tells_it_again(
    tmp_path: Path,
) -> None:
    """While a plan names a dataset, it stays (the plan's heartbeat keeps the plan). A
    plan's timeout (here 0.5 s) after no plan names it, it is dropped and its URLs no
    longer count. A client whose dataset lapsed gets ``unknown_dataset`` for its next
    plan, and ``announce`` tells the list again and installs the plan, with no error for
    its caller."""
    timeouts = {
        "prefetch.plan_timeout_s": 0.5,
        "server.lease_timeout_s": 0.4,  # heartbeats every 0.1 s
    }
    with connected(tmp_path, **timeouts) as (d, conn):
        server = d.daemon.server
        catalog = Catalog(URLS)
        assert announce(conn, "p", URLS[:10], "j", catalog)
        time.sleep(1.5)
        assert d.call(server.datasets.ids) == {dataset_key(catalog.id, ME)}
        assert announce(conn, "p", URLS[:3], "j")  # now a plan of URLs: none names it
        deadline = time.monotonic() + 10
        while d.call(server.datasets.ids):
            assert time.monotonic() < deadline, "the dataset never lapsed"
            time.sleep(0.1)
        assert d.call(lambda: server.dataset_urls.total_held) == 0
        assert announce(conn, "p", URLS[10:20], "j", catalog)
        assert plans(d) == [("p", URLS[10:20], catalog.id)]


def test_a_cached_dataset_tells_its_list_once_and_sends_plans_of_4_bytes_a_shard(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Two epochs of a CachedDataset: the URL list goes to the daemon once, when its first
    plan names a list the daemon does not hold; each plan carries 4 bytes per shard
    (base64), not the URLs; the daemon prefetches from those plans as from plans of URLs."""
    urls, _ = equal_shards(s3_server, bucket, 12)
    cfg = daemon_config(tmp_path, s3_server.endpoint_url)
    sent: list[dict[str, Any]] = []
    original = Connection.send

    def spy(self: Connection, header: dict[str, Any], **kw: Any) -> int:
        if header.get("op") in (Op.PLAN, Op.DATASET):
            sent.append({**header, "bytes": len(encode(header))})
        return original(self, header, **kw)

    with thread_daemon(cfg) as d, pytest.MonkeyPatch.context() as mp:
        mp.setattr(Connection, "send", spy)
        ds = CachedDataset(urls, socket=d.socket, shuffle=True, seed=1)
        for epoch in range(2):
            ds.set_epoch(epoch)
            assert len(list(ds)) == 12 * 8
        prefetched = d.call(lambda: d.daemon.status()["prefetch"]["prefetches"])
    told = [h for h in sent if h["op"] == Op.DATASET]
    planned = [h for h in sent if h["op"] == Op.PLAN]
    assert [h["urls"] for h in told] == [urls]
    # The first plan is refused (unknown_dataset), then sent again after the list.
    assert len(planned) == 3 and planned[0] == planned[1]
    assert all("urls" not in h for h in planned)
    assert [len(decode_index(h["index"])) for h in planned] == [24, 24, 24]
    assert all(h["bytes"] < 250 + 24 * 4 * 4 // 3 for h in planned), planned
    assert prefetched > 0


def test_readers_of_a_dataset_the_daemon_holds_do_not_send_its_list(tmp_path: Path) -> None:
    """The daemon holds one copy per list: a second connection (another DataLoader
    worker, another job) reading the same dataset sends only its plans."""
    cfg = daemon_config(tmp_path, None, **{"prefetch.lookahead": "0"})
    told: list[str] = []
    original = Connection.send

    def spy(self: Connection, header: dict[str, Any], **kw: Any) -> int:
        if header.get("op") == Op.DATASET:
            told.append(self.endpoint)
        return original(self, header, **kw)

    with thread_daemon(cfg) as d, pytest.MonkeyPatch.context() as mp:
        mp.setattr(Connection, "send", spy)
        first, second = Connection(d.socket), Connection(d.socket)
        try:
            assert announce(first, "a", URLS[:5], "j", Catalog(URLS))
            assert announce(second, "b", URLS[5:9], "j", Catalog(list(URLS)))
            assert len(told) == 1
            assert sorted(plans(d)) == [
                ("a", URLS[:5], catalog_id(URLS)),
                ("b", URLS[5:9], catalog_id(URLS)),
            ]
            assert d.call(lambda: d.daemon.status()["datasets"]) == {"datasets": 1, "urls": 200}
        finally:
            first.close()
            second.close()


def test_a_plan_of_urls_still_works_for_clients_that_do_not_know_datasets(
    tmp_path: Path,
) -> None:
    with connected(tmp_path) as (d, conn):
        assert announce(conn, "p", URLS[:3], "j")  # no catalog: the URLs themselves
        assert plans(d) == [("p", URLS[:3], "")]


def test_a_restarted_daemon_gets_a_plan_by_positions_back_whatever_the_lists_size(
    tmp_path: Path,
) -> None:
    """A daemon that restarts gets the reader's plan back within a heartbeat, as URLs. The
    list here is 30,000 URLs (1.6 MB), a request the daemon decodes in a worker thread: a
    plan resent by positions right after it would be handled first and refused."""
    config, socket = storeless_daemon(tmp_path)
    urls = [f"s3://b/shard-{i:06d}.tar" for i in range(30_000)]
    conn = Connection(socket)
    try:
        with ProcessDaemon(config, socket) as first:
            assert announce(conn, "p", urls[:100], "j", Catalog(urls))
            assert [p["dataset"] for p in first.status()["plans"]] == [catalog_id(urls)]
        with ProcessDaemon(config, socket) as second:
            deadline = time.monotonic() + 2.0 + 1.0
            while not second.status()["plans"]:
                assert time.monotonic() < deadline, "no plan within a heartbeat (2 s)"
                time.sleep(0.05)
            assert [p["shards"] for p in second.status()["plans"]] == [100]
    finally:
        conn.close()
