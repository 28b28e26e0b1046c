"""What the daemon holds for its clients, and the caps on it: leases (pins), plans,
datasets and the memory they weigh, counted per connection, per user and in total
(cached/bounds.py). One value the handlers that take holdings and the sessions that give
them back share; installs and expiries of plans take :attr:`Holdings.plans_lock`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..bounds import Bounds, MemoryQuotas
from ..datasets import Datasets
from ..hot.tier import HotTier
from ..leases import Leases
from ..planner import Planner
from ..quota import Quota


@dataclass
class Holdings:
    """Clients' holdings and their quotas; build with :meth:`of`."""

    leases: Leases
    planner: Planner
    plan_quota: Quota  # plans counted, per connection, user and in total
    plan_urls: Quota  # the URLs in plans, per user and in total
    memory: MemoryQuotas  # plans, datasets and replies waiting, in bytes (weights.py)
    datasets: Datasets  # told once; compact plans name positions in them
    dataset_urls: Quota  # their URLs, per user and in total
    plans_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one install or expiry

    @classmethod
    def of(
        cls, hot: HotTier, bounds: Bounds, lease_timeout_s: float, planner: Planner | None
    ) -> Holdings:
        """Empty holdings under ``bounds``; plans lapse with ``planner``'s timeout (one
        of ``lease_timeout_s`` where none is given)."""
        planner = planner if planner is not None else Planner(lease_timeout_s)
        plan_quota, plan_urls = bounds.plan_quotas()
        return cls(
            leases=Leases(hot, lease_timeout_s, bounds),
            planner=planner,
            plan_quota=plan_quota,
            plan_urls=plan_urls,
            memory=bounds.memory_quotas(),
            datasets=Datasets(planner.timeout_s),
            dataset_urls=bounds.dataset_quota(),
        )
