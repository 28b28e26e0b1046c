"""The ops that tell the daemon what comes: ``plan`` (a stream's shards in order, by URL
or by positions in a dataset) and ``dataset`` (a URL list told once). Each is weighed in
bytes and counted against its client's and user's caps before it is built, and a long one
is checked and indexed in the request pool, off the event loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from cached_wire.protocol import Header
from cached_wire.urls import check_all

from ..datasets import Dataset, checked, resolve
from ..datasets import key as dataset_key
from ..errors import ProtocolError
from ..offload import Offload
from ..owners import bounded, scoped
from ..peers import Peer
from ..planner import Plan, prepare
from ..weights import dataset_bytes, plan_bytes, strings_bytes
from .checks import integer, listed, text
from .holdings import Holdings

T = TypeVar("T")

# Plans longer than this are checked and indexed off the event loop.
PLAN_OFFLOAD_URLS = 10_000


def checked_plan(key: str, urls: list[Any], cursor: int, job: str) -> Plan:
    """The plan a request announces, its URLs checked (a bad one fails the plan now, not a
    prefetch later). Pure: runs in a worker thread for long plans."""
    if not all(isinstance(u, str) for u in urls):
        raise ProtocolError("request field 'urls' must be a list of strings")
    check_all(urls)
    return prepare(key, urls, cursor=cursor, job=job)


def indexed_plan(
    key: str, dataset: Dataset, index: str, cursor: int, job: str, *, most: int, owner: str
) -> Plan:
    """The plan a request names by positions in ``owner``'s ``dataset`` (its URLs were
    checked when the dataset was told). Pure: runs in a worker thread for long plans."""
    urls = resolve(dataset, index, most)
    return prepare(key, urls, cursor=cursor, job=job, dataset=dataset_key(dataset.id, owner))


class Plans:
    """The ``plan`` and ``dataset`` handlers."""

    def __init__(self, holdings: Holdings, offload: Offload, *, max_plan_shards: int) -> None:
        self.holdings = holdings
        self.offload = offload
        self.max_plan_shards = max_plan_shards

    async def _off_loop_if(
        self, user: str, long: bool, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """``fn(*args, **kwargs)``, in the request pool in ``user``'s turn where ``long``
        (cached/offload.py): a list of a million URLs checked or indexed on the event loop
        would stall every other client for seconds."""
        if not long:
            return fn(*args, **kwargs)
        return await self.offload.run(user, fn, *args, **kwargs)

    async def dataset(self, header: Header, client: Peer) -> None:
        """A dataset's URL list, told once for the plans that name positions in it."""
        held = self.holdings
        dataset_id = text(header, "dataset")
        urls = listed(header, self.max_plan_shards, "a dataset")
        user = client.user
        # One this user told: its digest was checked then, and its plans resolve against
        # its URLs, whatever these are. Another user's is not looked at (owners.py).
        dataset = held.datasets.find(dataset_id, user)
        if dataset is None:
            long = len(urls) > PLAN_OFFLOAD_URLS
            dataset = await self._off_loop_if(user, long, checked, dataset_id, urls)
        key, ident = dataset_key(dataset_id, user), client.ident
        weight = dataset_bytes(dataset.urls)
        held.dataset_urls.check(ident, key, len(dataset.urls), user)
        held.memory.datasets.admit(ident, key, weight, user)
        held.dataset_urls.admit(ident, key, len(dataset.urls), user)
        held.datasets.add(dataset, user)

    async def plan(self, header: Header, client: Peer) -> None:
        """A stream's plan, installed in the planner (replacing its plan of that name)."""
        held = self.holdings
        ident, user = client.ident, client.user
        # Under its user: another user's plan of the same name is another plan (owners.py).
        key = scoped(user, text(header, "plan"))
        cursor = integer(header, "cursor") if "cursor" in header else 0
        job = bounded(str(header.get("job", "")))
        # Weighed from the request and counted while it is built (beside the plan it
        # replaces: both are in memory then), so that a plan the caps refuse costs no
        # index (a million URLs' is some 450 MB) and plans built at once stay within the
        # caps; a plan of positions shares its dataset's strings. A long plan is weighed,
        # checked and indexed in a worker thread, then published in steps.
        build: Callable[[], Plan]
        shared = "dataset" in header
        if shared:
            dataset = held.datasets.get(text(header, "dataset"), user)
            index = header.get("index")
            if not isinstance(index, str):  # empty for a reader with no shards this time
                raise ProtocolError("request field 'index' must be a string")
            long = len(index) > PLAN_OFFLOAD_URLS * 4 * 4 // 3  # base64 of 4-byte positions
            named = (len(index) * 3 // 4 - (len(index) - len(index.rstrip("=")))) // 4
            weight = plan_bytes(named)
            most = self.max_plan_shards
            build = functools.partial(
                indexed_plan, key, dataset, index, cursor, job, most=most, owner=user
            )
        else:
            # I56: a plan names at most max_plan_shards shards.
            urls = listed(header, self.max_plan_shards, "a plan")
            long, named = len(urls) > PLAN_OFFLOAD_URLS, len(urls)
            weight = plan_bytes(named, await self._off_loop_if(user, long, strings_bytes, urls))
            build = functools.partial(checked_plan, key, urls, cursor, job)
        self._fits(client, key, named, weight)
        building = (key, "building")  # a key of its own (the sweep keeps it)
        held.memory.plans.admit(ident, building, weight, user)
        try:
            plan = await self._off_loop_if(user, long, build)
        finally:
            held.memory.plans.forget(building)
        if shared:
            weight = plan_bytes(len(plan.urls))
        # Again, as built: other plans may have been taken meanwhile.
        self._fits(client, key, len(plan.urls), weight)
        held.memory.plans.admit(ident, key, weight, user)
        held.plan_urls.admit(ident, key, len(plan.urls), user)
        held.plan_quota.admit(ident, key, 1, user)
        async with held.plans_lock:  # one install or expiry at a time
            for _ in held.planner.install(plan):
                await asyncio.sleep(0)

    def _fits(self, client: Peer, key: str, urls: int, weight: int) -> None:
        """Raise :class:`LimitExceeded` unless a plan of ``urls`` URLs weighing ``weight``
        bytes fits every plan cap of ``client`` and its user; counts nothing, so that a
        refusal leaves a plan already under ``key`` as it was."""
        held, ident, user = self.holdings, client.ident, client.user
        held.plan_quota.check(ident, key, 1, user)
        held.plan_urls.check(ident, key, urls, user)
        held.memory.plans.check(ident, key, weight, user)
