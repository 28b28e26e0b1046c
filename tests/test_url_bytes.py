"""What a request leaves in the daemon is weighed in bytes (issue 35, item 3): a URL longer
than any store allows is refused at the door, before the daemon remembers or fetches it,
and plans, datasets and replies waiting count their bytes against ``[server]``'s caps per
user and in total (cached/weights.py, cached/bounds.py), whatever their count.

Real parts: the moto S3 server behind the fault proxy (it sees every request the daemon
makes), a ``cached serve`` process every local user may reach, and the other users forked
children of this test that take other uids (tests/hostile.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cached_wire.catalog import catalog_id
from cached_wire.urls import MAX_KEY_BYTES

from tests.daemon import ProcessDaemon, dataset_shards
from tests.faultproxy import FaultProxy
from tests.hostile import as_other_user
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_ownership import shared_daemon
from tests.test_socket_access import NOBODY, needs_root

# Another user again, beside nobody.
THIRD = NOBODY - 1


def long_urls(bucket: str, n: int, chars: int = 1000) -> list[str]:
    """``n`` distinct URLs of ``chars`` characters (keys within S3's 1,024 bytes)."""
    head = f"s3://{bucket}/"
    return [f"{head}{i:08d}".ljust(chars, "k") for i in range(n)]


def refusal(reply: dict[str, Any]) -> tuple[str, str]:
    assert reply["ok"] is False, reply
    return reply["code"], reply["message"]


@needs_root
def test_a_url_longer_than_any_store_allows_is_refused_in_every_op_and_never_fetched(
    s3_server: S3Server, bucket: str, proxy: FaultProxy, public_dir: Path
) -> None:
    """The failure of issue 35: a plan of one 4 MiB URL was held (24 of them grew the
    daemon by 160 MiB) and fetched (the store answered 414). A URL with a key of 4 KiB
    is refused with ``bad_request`` by every op that takes URLs, and the store sees no
    request for it; a key of exactly 1,024 bytes, S3's most, is served."""
    urls = upload(s3_server, bucket, dataset_shards(1, 2))
    longest_key = "k" * MAX_KEY_BYTES
    s3_server.put(bucket, longest_key, dataset_shards(1, 2)[0])
    long = f"s3://{bucket}/" + "x" * 4096
    config, socket = shared_daemon(public_dir, proxy.endpoint_url, prefetch={})
    with ProcessDaemon(config, socket):
        replies = as_other_user(
            socket,
            [
                {"op": "open", "url": long, "stream": "s"},
                {"op": "read", "url": long, "stream": "s", "start": 0, "count": 1},
                {"op": "close", "url": long, "stream": "s"},
                {"op": "open", "url": urls[0], "stream": "s", "release": [long]},
                {"op": "plan", "plan": "p", "urls": [urls[0], long]},
                {"op": "dataset", "dataset": catalog_id([long]), "urls": [long]},
                {"op": "open", "url": f"s3://{bucket}/{longest_key}", "stream": "s"},
            ],
        )
        *refused, served = replies
        for reply in refused:
            code, message = refusal(reply)
            assert code == "bad_request", reply
            assert "longer than any store allows" in message, message
        assert served["ok"] and served["samples"] == 2, served
        time.sleep(0.5)  # a prefetch would have started by now
    assert not [seen.path for seen in proxy.seen if "xxxx" in seen.path]
    assert [s for s in proxy.seen if longest_key in s.path], "the longest key was not fetched"


@needs_root
def test_plans_are_capped_in_bytes_per_user_and_in_total_whatever_their_count(
    s3_server: S3Server, proxy: FaultProxy, public_dir: Path
) -> None:
    """Plans of long URLs, few in number, pass no count cap; their bytes do. One user's
    second plan passes ``max_plan_bytes_per_user`` and is refused, naming it, while
    another user's plan is taken; a third user's passes ``max_plan_bytes``. The first
    user's plan is held as it was."""
    config, socket = shared_daemon(
        public_dir,
        proxy.endpoint_url,
        prefetch={"lookahead": "0"},
        max_plan_bytes_per_user="1MiB",
        max_plan_bytes="2MiB",
    )
    plan = long_urls("b", 600)  # 600 x (1,049 + 450) bytes: 0.86 MiB
    with ProcessDaemon(config, socket) as daemon:
        first = as_other_user(
            socket,
            [
                {"op": "plan", "plan": "a", "urls": plan},
                {"op": "plan", "plan": "b", "urls": plan},
                {"op": "status"},
            ],
        )
        assert first[0]["ok"], first[0]
        code, message = refusal(first[1])
        assert code == "limit_exceeded", first[1]
        assert "[server] max_plan_bytes_per_user = 1.0 MiB" in message, message
        assert "uid 65534 holds 878.3 KiB of plans" in message, message
        assert message.endswith(
            "send fewer or shorter URLs, wait for others to lapse, or raise the limit"
        )
        assert [p["stream"] for p in first[2]["status"]["plans"]] == ["a"]
        # Another user has a budget of its own ...
        assert as_other_user(socket, [{"op": "plan", "plan": "a", "urls": plan}], uid=0)[0]["ok"]
        # ... and all of them together the daemon's.
        third = as_other_user(socket, [{"op": "plan", "plan": "a", "urls": plan}], uid=THIRD)
        code, message = refusal(third[0])
        assert code == "limit_exceeded" and "[server] max_plan_bytes = 2.0 MiB" in message, message
        users = sorted((p["user"], p["shards"]) for p in daemon.status()["plans"])
        assert users == [("uid 0", 600), ("uid 65534", 600)], users


@needs_root
def test_datasets_are_capped_in_bytes_per_user(
    s3_server: S3Server, proxy: FaultProxy, public_dir: Path
) -> None:
    """A dataset's URL list of long URLs passes ``max_dataset_bytes_per_user`` and is
    refused, naming it, though its count is far under the URL caps; one under it is
    held, and another user's plans cannot name it."""
    config, socket = shared_daemon(
        public_dir,
        proxy.endpoint_url,
        prefetch={"lookahead": "0"},
        max_dataset_bytes_per_user="1MiB",
    )
    small, large = long_urls("b", 600), long_urls("b", 1200)
    with ProcessDaemon(config, socket):
        replies = as_other_user(
            socket,
            [
                {"op": "dataset", "dataset": catalog_id(large), "urls": large},
                {"op": "dataset", "dataset": catalog_id(small), "urls": small},
            ],
        )
        code, message = refusal(replies[0])
        assert code == "limit_exceeded", replies[0]
        assert "[server] max_dataset_bytes_per_user = 1.0 MiB" in message, message
        assert replies[1]["ok"], replies[1]
        named = {"op": "plan", "plan": "p", "dataset": catalog_id(small), "index": ""}
        code, message = refusal(as_other_user(socket, [named], uid=THIRD)[0])
        assert code == "unknown_dataset", message


@needs_root
def test_replies_waiting_for_a_client_that_does_not_take_them_are_capped_in_bytes(
    s3_server: S3Server, bucket: str, proxy: FaultProxy, public_dir: Path
) -> None:
    """A client that sends reads and does not take their replies holds them in the daemon
    up to ``max_reply_bytes_per_user``; the replies past it are ``limit_exceeded`` answers,
    naming the key, with no payload, and a reader of another user is served meanwhile."""
    shards = dataset_shards(1, 20, payload=10_000)  # a read of all 20: ~200 KB
    url = upload(s3_server, bucket, shards)[0]
    config, socket = shared_daemon(
        public_dir,
        proxy.endpoint_url,
        prefetch={"lookahead": "0"},
        local_reads=False,
        max_reply_bytes_per_user="1MiB",
    )
    read = {"op": "read", "url": url, "stream": "s", "start": 0, "count": 20}
    with ProcessDaemon(config, socket):
        assert as_other_user(socket, [read], uid=THIRD)[0]["ok"]  # resident now
        replies = as_other_user(socket, [read] * 100, deaf_s=2.0)
        served = [r for r in replies if r["ok"]]
        refused = [r for r in replies if not r["ok"]]
        assert served and refused, (len(served), len(refused))
        assert all(r["payload_bytes"] >= 200_000 for r in served)
        for reply in refused:
            code, message = refusal(reply)
            assert code == "limit_exceeded", reply
            assert "[server] max_reply_bytes_per_user = 1.0 MiB" in message, message
            assert message.endswith(
                "take the replies waiting before asking again, or raise the limit"
            )
            assert reply["payload_bytes"] == 0
        # What waited in the daemon: at most the cap (ZeroMQ's queue holds the rest).
        assert len(served) * 200_000 < (1 << 20) + 40 * 210_000, len(served)


@needs_root
def test_a_name_longer_than_256_characters_is_refused_before_anything_keeps_it(
    s3_server: S3Server, bucket: str, proxy: FaultProxy, public_dir: Path
) -> None:
    """A plan key, stream, dataset or job name is kept as long as what it names (65,536
    leases of 1 MiB stream names would be 64 GiB, counted as 65,536 leases): one over 256
    characters is ``bad_request``, and nothing is held or fetched for the request."""
    url = upload(s3_server, bucket, dataset_shards(1, 2))[0]
    name = "n" * (1 << 20)
    config, socket = shared_daemon(public_dir, proxy.endpoint_url, prefetch={})
    with ProcessDaemon(config, socket) as daemon:
        replies = as_other_user(
            socket,
            [
                {"op": "open", "url": url, "stream": name},
                {"op": "read", "url": url, "stream": name, "start": 0, "count": 1},
                {"op": "plan", "plan": name, "urls": [url]},
                {"op": "plan", "plan": "p", "urls": [url], "job": name},
                {"op": "plan", "plan": "p", "dataset": name, "index": ""},
                {"op": "dataset", "dataset": name, "urls": [url]},
            ],
        )
        for reply in replies:
            code, message = refusal(reply)
            assert code == "bad_request", reply
            assert message.endswith("may be at most 256 characters, not 1048576"), message
        status = daemon.status()
        assert status["plans"] == [] and status["hot"]["pinned_shards"] == 0
    assert proxy.requests("GET") == []
