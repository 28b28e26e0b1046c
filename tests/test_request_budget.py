"""Several nodes start cold against one store that limits its request rate (issue 24).

The store: the fault proxy in front of moto or RGW, answering 503 SlowDown above
``LIMIT`` requests per second in total (a token bucket holding two requests per node).
The nodes: three real daemons, each with its own hot tier and socket, each asked to
fetch its own 20 shards at once, as the nodes of a job with ``placement="node"`` do at
a cold start. What a user relies on: no read fails, the store sees at most its limit,
and, with each node's share set (``[s3] max_requests_per_s``), the fill at the store
(its first request to its last) takes about what the limit allows.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from cached_client.errors import CachedClientError
from cached_client.transport import Connection
from cached_wire.protocol import Op

from tests.daemon import ThreadDaemon, daemon_config, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_integrity import make_shards, upload

pytestmark = pytest.mark.stores

NODES = 3
SHARDS_PER_NODE = 20
# Requests per second, the whole store: low enough that each daemon's share, not how
# fast a loaded moto answers its 3 downloads at once, sets the pace.
LIMIT = 15.0
BURST = 2 * NODES  # the store's bucket (see limited)


def prefetch(socket: str, urls: list[str]) -> list[str]:
    """Open every URL as ``cached prefetch`` does (8 in flight); the errors, if any."""
    conn = Connection(socket, connect_timeout_s=3.0)
    errors: list[str] = []
    try:
        pending: list[int] = []
        todo = list(urls)
        while todo or pending:
            while todo and len(pending) < 8:
                header = {"op": Op.OPEN, "url": todo.pop(0), "stream": "p", "pin": False}
                pending.append(conn.send(header | {"prefetch": True}))
            try:
                conn.wait(pending.pop(0))
            except CachedClientError as exc:
                errors.append(str(exc))
    finally:
        conn.close()
    return errors


def cold_start(
    tmp: Path, proxy: FaultProxy, urls: list[str], **s3: Any
) -> tuple[float, list[str], list[dict[str, Any]]]:
    """Start ``NODES`` daemons, let each fetch its share of ``urls`` at the same moment;
    the seconds until all had their shards, every read error, each one's request budget."""
    shares = [urls[n::NODES] for n in range(NODES)]
    errors: list[str] = []
    with ExitStack() as stack:
        daemons: list[ThreadDaemon] = []
        for n in range(NODES):
            (tmp / f"node{n}").mkdir()
            # Slots to spare: at 5 requests a second a node with 3 prefetch slots keeps
            # pace only while a GET takes under 0.6 s, which a loaded RGW does not always
            # (a full suite's run filled in 4.83 s against the limit's 4.0); with 7, the
            # share, not the store's latency, sets the pace, as the test means.
            values = {"s3.retry_attempts": 6, "prefetch.concurrency": 8} | {
                f"s3.{k}": v for k, v in s3.items()
            }
            cfg = daemon_config(tmp / f"node{n}", proxy.endpoint_url, **values)
            daemons.append(stack.enter_context(thread_daemon(cfg)))
        go = threading.Barrier(NODES + 1)

        def node(d: ThreadDaemon, share: list[str]) -> None:
            go.wait()
            errors.extend(prefetch(d.socket, share))

        threads = [
            threading.Thread(target=node, args=(d, share))
            for d, share in zip(daemons, shares, strict=True)
        ]
        for t in threads:
            t.start()
        go.wait()
        start = time.monotonic()
        for t in threads:
            t.join(timeout=120)
        took = time.monotonic() - start
        budgets = [d.call(d.daemon._requests_status) for d in daemons]
    return took, errors, budgets


@pytest.fixture
def limited(proxy: FaultProxy) -> FaultProxy:
    proxy.max_requests_per_s = LIMIT
    # Two requests per node: each daemon spaces its own evenly at its share, but they cross
    # a loaded machine's scheduler to the proxy, and one that arrives late brings it closer
    # to the next (a full suite's run saw one SlowDown so with a bucket of one per node,
    # at 15 in the busiest second). A node above its share still drains it.
    proxy.request_burst = BURST
    return proxy


@pytest.fixture
def shard_urls(s3_server: S3Server, bucket: str) -> list[str]:
    tars, _ = make_shards(NODES * SHARDS_PER_NODE, seed=24)
    return upload(s3_server, bucket, tars)


def test_nodes_at_their_share_fill_at_the_store_limit_without_slowdown(
    tmp_path: Path, limited: FaultProxy, shard_urls: list[str]
) -> None:
    took, errors, budgets = cold_start(
        tmp_path, limited, shard_urls, max_requests_per_s=LIMIT / NODES
    )
    assert errors == []
    load = limited.limited_load()
    assert load.answered == len(shard_urls)  # one GET a shard: nothing asked twice
    assert load.refused == 0, f"the store said SlowDown {load.refused} times"
    assert load.most_in_1s <= LIMIT + BURST  # a second holds the rate and the store's burst
    # The fill at the store, its first request to its last, against what the limit
    # allows; the whole, from the go to the last shard in place, adds each daemon's
    # start of its S3 clients (about 0.3 s) and the last answers.
    allowed = len(shard_urls) / LIMIT
    fill = load.span_s
    assert fill <= 1.2 * allowed, f"filled in {fill:.2f} s; the limit allows {allowed:.2f} s"
    assert took <= fill + 1.5
    assert all(b["sent"] == SHARDS_PER_NODE and b["slowed_down"] == 0 for b in budgets)


def test_nodes_with_no_share_set_slow_down_and_no_read_fails(
    tmp_path: Path, limited: FaultProxy, shard_urls: list[str]
) -> None:
    _, errors, budgets = cold_start(tmp_path, limited, shard_urls)
    assert errors == []
    load = limited.limited_load()
    assert load.answered == len(shard_urls)
    # The nodes did run into the limit, and each one it stopped slowed down.
    assert load.refused > 0
    assert all(b["slowed_down"] > 0 for b in budgets if b["throttled"])
    assert load.most_in_1s <= LIMIT + BURST
    # Slower than at the shares (the rate is found by halving and climbing back), yet
    # bounded: without the budget the nodes gave up instead (issue 24).
    assert load.span_s <= 3 * len(shard_urls) / LIMIT
