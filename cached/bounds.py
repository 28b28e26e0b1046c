"""What one connection, one local user, and every client together may hold in the daemon:
the ``[server]`` bounds as one value for :class:`cached.server.Server`
(docs/operations.md, "Fairness and bounds on a shared node")."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ServerConfig, format_size
from .quota import Cap, Quota


@dataclass(frozen=True)
class Bounds:
    """The bounds; the defaults are ``[server]``'s."""

    max_request_bytes: int = ServerConfig.max_request_bytes
    reply_timeout_s: float = ServerConfig.reply_timeout_s
    max_requests_per_client: int = ServerConfig.max_requests_per_client
    max_plans_per_client: int = ServerConfig.max_plans_per_client
    max_plans_per_user: int = ServerConfig.max_plans_per_user
    max_plans: int = ServerConfig.max_plans
    max_plan_urls_per_user: int = ServerConfig.max_plan_urls_per_user
    max_plan_urls: int = ServerConfig.max_plan_urls
    max_leases_per_client: int = ServerConfig.max_leases_per_client
    max_leases_per_user: int = ServerConfig.max_leases_per_user
    max_leases: int = ServerConfig.max_leases
    max_pinned_share_per_user: float = ServerConfig.max_pinned_share_per_user
    max_plan_bytes_per_user: int = ServerConfig.max_plan_bytes_per_user
    max_plan_bytes: int = ServerConfig.max_plan_bytes
    max_dataset_bytes_per_user: int = ServerConfig.max_dataset_bytes_per_user
    max_dataset_bytes: int = ServerConfig.max_dataset_bytes
    max_reply_bytes_per_user: int = ServerConfig.max_reply_bytes_per_user
    max_reply_bytes: int = ServerConfig.max_reply_bytes

    @classmethod
    def from_config(cls, server: ServerConfig) -> Bounds:
        """The bounds ``[server]`` sets."""
        return cls(**{name: getattr(server, name) for name in cls.__dataclass_fields__})

    def plan_quotas(self) -> tuple[Quota, Quota]:
        """Plans counted (per connection, per user, in total), and their URLs (per user, in
        total: what a plan costs in memory, 270-560 bytes each: bench/bounds_rss.py,
        bench/plan_wire.py)."""
        plans = Quota(
            "plans",
            per_client=Cap(self.max_plans_per_client, "[server] max_plans_per_client"),
            per_user=Cap(self.max_plans_per_user, "[server] max_plans_per_user"),
            total=Cap(self.max_plans, "[server] max_plans"),
        )
        urls = Quota(
            "URLs in plans",
            per_user=Cap(self.max_plan_urls_per_user, "[server] max_plan_urls_per_user"),
            total=Cap(self.max_plan_urls, "[server] max_plan_urls"),
        )
        return plans, urls

    def dataset_quota(self) -> Quota:
        """The URLs of the datasets told (per user, in total), under the caps of the URLs in
        plans: a dataset's URL is what a planned URL told in full costs, or less."""
        return Quota(
            "URLs in datasets",
            per_user=Cap(self.max_plan_urls_per_user, "[server] max_plan_urls_per_user"),
            total=Cap(self.max_plan_urls, "[server] max_plan_urls"),
        )

    def memory_quotas(self) -> MemoryQuotas:
        """What requests leave in the daemon's memory, in bytes (cached/weights.py), per
        user and in total: plans' and datasets' URL lists, and replies waiting."""

        def quota(what: str, kind: str, advice: str) -> Quota:
            user, total = f"max_{kind}_bytes_per_user", f"max_{kind}_bytes"
            return Quota(
                what,
                per_user=Cap(getattr(self, user), f"[server] {user}"),
                total=Cap(getattr(self, total), f"[server] {total}"),
                show=format_size,
                advice=advice,
            )

        lists = "send fewer or shorter URLs, wait for others to lapse, or raise the limit"
        return MemoryQuotas(
            plans=quota("of plans", "plan", lists),
            datasets=quota("of datasets", "dataset", lists),
            replies=quota(
                "of replies waiting",
                "reply",
                "take the replies waiting before asking again, or raise the limit",
            ),
        )

    def lease_quotas(self, capacity_bytes: int) -> tuple[Quota, Quota]:
        """Leases counted (per connection, per user, in total), and the bytes of the shards
        they pin per user (a share of the hot tier's ``capacity_bytes``)."""
        leases = Quota(
            "pinned shards",
            per_client=Cap(self.max_leases_per_client, "[server] max_leases_per_client"),
            per_user=Cap(self.max_leases_per_user, "[server] max_leases_per_user"),
            total=Cap(self.max_leases, "[server] max_leases"),
        )
        share = self.max_pinned_share_per_user
        pinned = Quota(
            "of pinned shards",
            per_user=Cap(
                limit := int(capacity_bytes * share),
                "[server] max_pinned_share_per_user",
                f"[server] max_pinned_share_per_user = {share:g} of the hot tier: "
                f"{format_size(limit)}",
            ),
            show=format_size,
        )
        return leases, pinned


@dataclass(frozen=True)
class MemoryQuotas:
    """The byte quotas of :meth:`Bounds.memory_quotas`."""

    plans: Quota
    datasets: Quota
    replies: Quota
