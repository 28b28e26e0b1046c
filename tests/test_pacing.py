"""The request budget (cached/stores/pacing.py) and the retry loop that takes from it.

The pacer runs on the real event loop and the real clock: the rates are high enough
that a test takes a fraction of a second, and the bounds leave room for a loaded machine.
"""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest
from botocore.exceptions import ClientError

from cached.config import ConfigError, load
from cached.stores.pacing import RequestPacer
from cached.stores.retry import RetryPolicy, StoreUnavailable, retrying

POLICY = RetryPolicy(attempts=3, base_delay_s=0.0, max_delay_s=0.0)


def slow_down() -> ClientError:
    """What botocore raises for S3's 503 SlowDown."""
    return ClientError(
        {
            "Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
            "ResponseMetadata": {"HTTPStatusCode": 503},
        },
        "GetObject",
    )


async def send(pacer: RequestPacer, n: int) -> float:
    """Take ``n`` requests, one at a time; the seconds it took."""
    start = time.monotonic()
    for _ in range(n):
        await pacer.acquire()
    return time.monotonic() - start


def test_a_ceiling_spaces_the_requests_evenly() -> None:
    pacer = RequestPacer(50.0, rng=random.Random(1))
    took = asyncio.run(send(pacer, 26))
    # 25 intervals of 20 ms after the first (which waits a random fraction of one).
    assert 0.48 <= took <= 0.9
    assert pacer.requests == 26
    assert pacer.waited_s > 0.4


def test_an_idle_budget_does_not_save_up_a_burst() -> None:
    async def run() -> float:
        pacer = RequestPacer(50.0, rng=random.Random(1))
        # Idle for a second: 50 tokens' worth, but the bucket holds one.
        await asyncio.sleep(1.0)
        return await send(pacer, 20)

    # 19 intervals of 20 ms after the first (0.38 s); a bucket that saved up the idle
    # second would let all 20 go at once.
    assert asyncio.run(run()) >= 0.3


def test_no_ceiling_lets_every_request_go_until_the_store_throttles() -> None:
    pacer = RequestPacer(0.0)
    assert not pacer.paced
    took = asyncio.run(send(pacer, 500))
    assert took < 0.2
    assert pacer.waited_s == 0.0


def test_the_first_slowdown_paces_at_half_the_rate_sent() -> None:
    async def run() -> RequestPacer:
        pacer = RequestPacer(0.0)
        for _ in range(21):  # 40 requests/s: 20 intervals of 25 ms
            await pacer.acquire()
            await asyncio.sleep(0.025)
        assert pacer.throttled(time.monotonic())
        return pacer

    pacer = asyncio.run(run())
    assert pacer.paced
    # Measured over the half second they took (late wake-ups make it a little less).
    assert 15.0 <= pacer.rate <= 21.0
    # Paced from now on: 10 more requests take about 0.45 s at 20/s.
    took = asyncio.run(send(pacer, 10))
    assert took >= 0.4


def test_one_round_of_slowdowns_halves_the_rate_once() -> None:
    async def run() -> None:
        pacer = RequestPacer(64.0)
        sent = [await pacer.acquire() for _ in range(4)]
        # Four requests in flight are all throttled: one decrease, not four.
        assert all(pacer.throttled(at) for at in sent)
        assert pacer.rate == pytest.approx(32.0)
        assert pacer.decreases == 1 and pacer.throttles == 4
        # A request sent after that decrease and throttled too: the next round.
        assert pacer.throttled(await pacer.acquire())
        assert pacer.rate == pytest.approx(16.0)

    asyncio.run(run())


def test_the_rate_stops_at_its_floor_and_then_a_slowdown_counts() -> None:
    async def run() -> None:
        pacer = RequestPacer(640.0)  # floor: 10/s
        free = [pacer.throttled(await pacer.acquire()) for _ in range(8)]
        # 640 -> 320 -> ... -> 10 in six halvings; at the floor a SlowDown is not free.
        assert pacer.rate == pytest.approx(10.0)
        assert free[:6] == [True] * 6
        assert free[-1] is False

    asyncio.run(run())


def test_successes_raise_the_rate_back_to_the_ceiling_and_no_further() -> None:
    async def run() -> RequestPacer:
        pacer = RequestPacer(200.0)
        pacer.throttled(await pacer.acquire())
        assert pacer.rate == pytest.approx(100.0)
        pacer.succeeded(100)  # about one second of full use: + ceiling / 8
        assert pacer.rate == pytest.approx(125.0)
        pacer.succeeded(10_000)
        return pacer

    assert asyncio.run(run()).rate == 200.0


def test_a_request_of_many_parts_leaves_the_budget_in_debt() -> None:
    async def run() -> float:
        pacer = RequestPacer(40.0, rng=random.Random(2))
        await pacer.acquire(8)  # awscrt sends the 8 parts of a GET at once
        start = time.monotonic()
        await pacer.acquire()  # waits out the 8 (7 beyond the one token there was)
        return time.monotonic() - start

    assert asyncio.run(run()) >= 0.15


def test_nodes_started_together_do_not_send_at_once() -> None:
    firsts = []
    for seed in range(8):
        pacer = RequestPacer(10.0, rng=random.Random(seed))
        firsts.append(asyncio.run(send(pacer, 1)))
    # Each waits a random fraction of the 100 ms interval: spread, not together.
    assert max(firsts) - min(firsts) > 0.03


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_a_ceiling_must_be_a_finite_rate(bad: float) -> None:
    with pytest.raises(ValueError, match="max_requests_per_s"):
        RequestPacer(bad)


@pytest.mark.parametrize("bad", ["-5", "inf", "nan", "fast"])
def test_the_config_refuses_a_ceiling_that_is_no_rate(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"(?i)max_requests_per_s"):
        load(None, env={"CACHED_S3_MAX_REQUESTS_PER_S": bad})


# --- the retry loop ------------------------------------------------------------------------


class Store:
    """Answers SlowDown ``throttled`` times, then OK."""

    def __init__(self, throttled: int) -> None:
        self.left = throttled
        self.calls = 0

    async def get(self) -> str:
        self.calls += 1
        if self.left:
            self.left -= 1
            raise slow_down()
        return "body"


def test_without_a_budget_slowdowns_use_up_the_attempts() -> None:
    store = Store(throttled=5)
    with pytest.raises(StoreUnavailable, match=r"gave up after 3 attempt\(s\).*SlowDown"):
        asyncio.run(retrying(store.get, policy=POLICY, what="GET x"))


def test_with_a_budget_slowdowns_slow_it_down_instead_of_failing_the_read() -> None:
    store = Store(throttled=5)
    pacer = RequestPacer(2000.0)
    got = asyncio.run(retrying(store.get, policy=POLICY, what="GET x", pacer=pacer))
    assert got == "body" and store.calls == 6
    # Five halvings, and the one success's additive step (ceiling / 8 / rate).
    assert pacer.decreases == 5 and pacer.rate == pytest.approx(2000.0 / 32 + 4.0)


def test_a_key_throttled_whatever_the_rate_still_fails_in_the_end() -> None:
    pacer = RequestPacer(1000.0)
    store = Store(throttled=1_000)
    get = store.get

    async def throttled_while_others_succeed() -> str:
        # Other keys' successes bring the rate back up between this key's SlowDowns, so
        # the pacer never reaches its floor: every SlowDown would be free.
        pacer.succeeded(100_000)
        return await get()

    store.get = throttled_while_others_succeed  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable, match=r"gave up after 12 attempt\(s\)"):
        asyncio.run(retrying(store.get, policy=POLICY, what="GET x", pacer=pacer))


def test_an_attempt_takes_what_it_costs() -> None:
    pacer = RequestPacer(0.0)
    store = Store(throttled=0)
    asyncio.run(retrying(store.get, policy=POLICY, what="GET x", pacer=pacer, cost=lambda: 4))
    assert pacer.requests == 4


def test_after_a_slowdown_the_next_request_waits_its_new_interval() -> None:
    async def run() -> float:
        pacer = RequestPacer(10.0)
        sent = await pacer.acquire()
        await asyncio.sleep(0.15)  # a full token has come back meanwhile
        pacer.throttled(sent)  # now 5/s, and what the bucket held is spent
        start = time.monotonic()
        await pacer.acquire()
        return time.monotonic() - start

    assert asyncio.run(run()) >= 0.15
