"""A plan, a cursor, a lease and a listing belong to the user who made them (issue 35,
item 2; cached/owners.py): another local user who sends requests under a reader's names
(a plan key, a stream, a read's ``plan`` and ``pos``) acts on plans and leases of its own,
never the reader's, and ``status`` shows each user only its own plans.

Real parts: the moto S3 server behind the fault proxy (it counts the daemon's GETs), a
``cached serve`` process with a socket every local user may reach, the reader on a ZeroMQ
socket of this test (root), and the other user a forked child that takes uid ``nobody``
(tests/hostile.py).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq
from cached_wire.protocol import PROTOCOL_VERSION

from tests.daemon import ProcessDaemon, dataset_shards, serve_config
from tests.faultproxy import FaultProxy
from tests.hostile import as_other_user, ask, raw_dealer, until
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_socket_access import needs_root

# The reader's plan key and stream: names that follow from its job, so anyone may know them.
KEY = "job-7/rank-0/worker-0"
STREAM = "job-7/rank-0/worker-0/stream"


def shared_daemon(
    directory: Path, endpoint_url: str, *, prefetch: dict[str, Any], **server: Any
) -> tuple[Path, str]:
    """A ``cached serve`` config in ``directory`` (one every user may search) whose socket
    admits every local user (mode 0666, the documented any-local-user drop-in)."""
    sections = {"server": {"socket_mode": "0666", **server}, "prefetch": prefetch}
    return serve_config(directory, endpoint_url, sections=sections)


def fetched(proxy: FaultProxy, url: str) -> bool:
    """Whether the daemon asked the store for ``url``'s object's bytes."""
    key = url.split("/", 3)[3]
    return any(seen.path.endswith(key) for seen in proxy.requests("GET"))


def own_plans(status: dict[str, Any], user: str) -> list[tuple[str, int, int, str]]:
    """(stream, shards, cursor, job) of the plans ``status`` lists as ``user``'s."""
    return [
        (p["stream"], p["shards"], p["cursor"], p["job"])
        for p in status["plans"]
        if p.get("user", user) == user
    ]


@needs_root
def test_another_user_under_the_readers_names_acts_only_on_its_own(
    s3_server: S3Server, bucket: str, proxy: FaultProxy, public_dir: Path
) -> None:
    """The failures of issue 35: another user's ``plan`` under the reader's key replaced
    it (prefetch and eviction followed the other user's URLs), and dropped it when that
    user's connection went, so the reader's prefetch stopped for the epoch; its ``read``
    with the reader's ``plan`` and ``pos`` moved the reader's cursor; its ``close`` of the
    reader's stream released the reader's pin; and ``status`` listed every user's plans.
    Now each is the other user's own: the reader's plan, cursor and pin stay, prefetch
    goes on following the reader's URLs, and each user sees its own plans."""
    shards = dataset_shards(8, 20, payload=5000)
    urls = upload(s3_server, bucket, shards)
    size = len(shards[0])
    config, socket = shared_daemon(
        public_dir,
        proxy.endpoint_url,
        # A window of about two shards: prefetch fetches what follows the reader's cursor.
        prefetch={"lookahead": int(2.5 * size), "plan_grace_s": 0.2},
    )
    with ProcessDaemon(config, socket) as daemon:
        ctx: zmq.Context[Any] = zmq.Context()
        reader = raw_dealer(ctx, socket)
        try:
            assert ask(reader, {"op": "hello", "id": 1, "v": PROTOCOL_VERSION})["ok"]
            plan = {"op": "plan", "id": 2, "plan": KEY, "urls": urls, "job": "reader"}
            assert ask(reader, plan)["ok"]
            assert until(lambda: fetched(proxy, urls[0]) and fetched(proxy, urls[1]))
            opened = ask(reader, {"op": "open", "id": 3, "url": urls[3], "stream": STREAM})
            assert opened["ok"], opened
            assert daemon.status()["hot"]["pinned_shards"] == 1

            replies = as_other_user(
                socket,
                [
                    {"op": "status"},
                    # The reader's cursor, as a read carries it.
                    {
                        "op": "read",
                        "url": urls[0],
                        "stream": "mine",
                        "start": 0,
                        "count": 1,
                        "plan": KEY,
                        "pos": 6,
                    },
                    # The reader's pin.
                    {"op": "close", "url": urls[3], "stream": STREAM},
                    # The reader's plan key, naming a shard already resident.
                    {"op": "plan", "plan": KEY, "urls": urls[:1], "job": "other"},
                    {"op": "status"},
                ],
            )
            assert all(r["ok"] for r in replies), replies
            before, after = replies[0]["status"], replies[-1]["status"]
            # It sees no plan of the reader's, then its own, without a user beside it.
            assert before["plans"] == [], before["plans"]
            assert [(p["stream"], p["shards"], p["job"]) for p in after["plans"]] == [
                (KEY, 1, "other")
            ]
            assert "user" not in after["plans"][0]
            # Its connection is gone, and its plan with it after the grace.
            time.sleep(1.0)

            status = ask(reader, {"op": "status", "id": 4})["status"]
            # Root sees every user's plans, each with its user: the reader's is whole.
            assert own_plans(status, "uid 0") == [(KEY, 8, 0, "reader")], status["plans"]
            assert [p["user"] for p in status["plans"]] == ["uid 0"], status["plans"]
            assert status["hot"]["pinned_shards"] == 1, "the other user released the pin"

            # The reader moves on: prefetch follows its plan to the shards after its cursor.
            read = {
                "op": "read",
                "id": 5,
                "url": urls[3],
                "stream": STREAM,
                "start": 0,
                "count": 1,
                "plan": KEY,
                "pos": 4,
            }
            assert ask(reader, read)["ok"]
            assert until(lambda: fetched(proxy, urls[4]) and fetched(proxy, urls[5])), (
                "prefetch no longer follows the reader's plan"
            )
            status = ask(reader, {"op": "status", "id": 6})["status"]
            assert own_plans(status, "uid 0") == [(KEY, 8, 4, "reader")]

            # The admin HTTP /status knows no user: its plans name no stream nor user.
            with urllib.request.urlopen(f"{status['http']}/status", timeout=10) as page:
                listed = json.load(page)["plans"]
            assert [(p["shards"], p["job"]) for p in listed] == [(8, "reader")]
            assert not {"stream", "user"} & set(listed[0])
        finally:
            reader.close(0)
            ctx.term()
