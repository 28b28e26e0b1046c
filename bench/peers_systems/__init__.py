"""The systems of ``bench/peers.py``, side by side on one shaped S3 link.

One module per system (``sys_*.py``); each defines a subclass of :class:`base.Peer` with a
``prepare`` (the system's own conversion of the dataset, if it needs one; its seconds) and
the per-epoch loop of :meth:`base.Peer.run_epoch`. ``runner.py`` runs one system, in a
subprocess of its own, and talks to the driver over its stdin and stdout.

The peers' packages (mosaicml-streaming, litdata, s3torchconnector, matplotlib) are not in
the project's own virtual environment, where mypy checks this code: the modules import them
inside functions, through ``importlib`` (typed ``Any``).

Mosaic Streaming and litdata have two rows each: one with its cache limited to the hot
tier's size (the comparison with cached's bounded hot tier), and one with its default cache,
as its users run it (``cache_limit=False``: the module passes no limit). The two rows of a
module share its class and its conversion: ``bench/peers.py`` converts once per module and
rate, and both rows read what it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SystemInfo:
    """A row of the tables: which module runs it, and what it is."""

    name: str  # the row's name in the tables
    module: str  # bench.peers_systems.<module>
    cls: str  # the Peer subclass in it
    converts: bool  # has a conversion of its own (prepare writes to the store)
    what: str  # one line for the docs and the JSON
    # Given the cache limit (the hot tier's capacity); False: the system's default cache,
    # with no limit passed (base.Spec.cache_limit). Only sys_mosaic and sys_litdata read it.
    cache_limit: bool = True


SYSTEMS: tuple[SystemInfo, ...] = (
    SystemInfo(
        "cached CachedDataset",
        "sys_cached",
        "CachedDatasetPeer",
        False,
        "CachedDataset(shuffle) in a 2-worker DataLoader, a fresh `cached serve` per run "
        "(hot tier = the cache limit)",
    ),
    SystemInfo(
        "cached FastLoader",
        "sys_cached",
        "FastLoaderPeer",
        False,
        "FastLoader(shuffle) in the training process (its own loop, no workers), a fresh "
        "`cached serve` per run",
    ),
    SystemInfo(
        "webdataset pipe:curl",
        "sys_wds",
        "WdsCurlPeer",
        False,
        "wds.WebDataset('pipe:curl -s -f <presigned URL>') + shuffle, 2-worker DataLoader; "
        "no cache: every epoch reads from S3",
    ),
    SystemInfo(
        "webdataset +cache_dir",
        "sys_wds",
        "WdsCachePeer",
        False,
        "the same with WebDataset(cache_dir=..., cache_size=the cache limit): its own LRU "
        "file cache",
    ),
    SystemInfo(
        "Mosaic Streaming",
        "sys_mosaic",
        "MosaicPeer",
        True,
        "StreamingDataset(remote=MDS in S3, cache_limit, shuffle) in a 2-worker DataLoader",
    ),
    SystemInfo(
        "Mosaic Streaming (default cache)",
        "sys_mosaic",
        "MosaicPeer",
        True,
        "the same with its default cache (no cache_limit: it keeps every shard it "
        "downloads); the same MDS conversion",
        cache_limit=False,
    ),
    SystemInfo(
        "litdata",
        "sys_litdata",
        "LitdataPeer",
        True,
        "litdata StreamingDataset(s3://, max_cache_size, shuffle) in its StreamingDataLoader "
        "(2 workers)",
    ),
    SystemInfo(
        "litdata (default cache)",
        "sys_litdata",
        "LitdataPeer",
        True,
        "the same with its default cache (no max_cache_size: 75% of the free disk, leaving "
        "50 GB); the same litdata.optimize conversion",
        cache_limit=False,
    ),
    SystemInfo(
        "s3torchconnector",
        "sys_s3torch",
        "S3TorchPeer",
        False,
        "S3IterableDataset.from_objects(tar shards, sharded over workers) + webdataset's tar "
        "expander + shuffle, 2-worker DataLoader; no cache",
    ),
)

BY_NAME = {s.name: s for s in SYSTEMS}
BASELINE = SYSTEMS[0].name
