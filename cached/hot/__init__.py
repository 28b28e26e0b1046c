"""The hot tier: a bounded directory of shard files on local NVMe (``tier.HotTier``), their
indexes and checksums, reads from them, and the checks of what it holds
(docs/architecture.md, invariants I1-I18)."""
