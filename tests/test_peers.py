"""bench/peers.py's bookkeeping, without running a peer: Mosaic's and litdata's two rows (the
cache limited to the hot tier, and their default cache) share one conversion per module,
pass the limit or leave it out, and a default cache over the hot tier is marked, not failed.
The peers themselves run in ``make bench-peers-small`` (their packages are in .venv-peers)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from bench import peers
from bench.peers_systems import BY_NAME, SYSTEMS, base, sys_litdata, sys_mosaic

MB = 1_000_000


def spec(**kw: Any) -> base.Spec:
    values: dict[str, Any] = dict(
        system="litdata",
        mode="epochs",
        endpoint="http://127.0.0.1:1",
        bucket="b",
        tar_keys=["wds/a.tar"],
        tar_dir="/nonexistent",
        samples=100,
        payload_bytes=100 * 1000,
        tar_bytes=120_000,
        shard_bytes=120_000,
        workdir="/nonexistent/run",
        capacity=10 * MB,
    )
    return base.Spec(**{**values, **kw})


def test_each_converting_module_has_a_limited_and_a_default_cache_row() -> None:
    for module in ("sys_mosaic", "sys_litdata"):
        rows = [s for s in SYSTEMS if s.module == module]
        assert [s.cache_limit for s in rows] == [True, False]
        assert all(s.converts for s in rows)
        assert len({s.cls for s in rows}) == 1
    assert all(s.cache_limit for s in SYSTEMS if s.module not in ("sys_mosaic", "sys_litdata"))


def test_one_conversion_per_module_whichever_rows_are_chosen() -> None:
    assert [s.name for s in peers.conversions(SYSTEMS)] == ["Mosaic Streaming", "litdata"]
    only_default = peers.choose_systems(["litdata (default"])
    assert [s.name for s in only_default] == ["litdata (default cache)"]
    assert [s.name for s in peers.conversions(only_default)] == ["litdata"]
    assert [s.name for s in peers.conversions(peers.choose_systems(["mosaic"]))] == [
        "Mosaic Streaming"
    ]
    assert peers.conversions(peers.choose_systems(["cached"])) == []


def test_the_spec_carries_the_choice() -> None:
    s = spec(cache_limit=False)
    assert base.Spec.from_json(s.to_json()) == s
    assert spec().cache_limit is True


def epochs_run(name: str, peak: int) -> peers.Run:
    run = peers.Run(name, 400.0, "2x", 0, peak_disk_bytes=peak)
    run.epochs = [
        {
            "epoch": 1,
            "wall_s": 1.0,
            "samples": 100,
            "first_batch_s": 0.1,
            "link_bytes": 1000,
            "client_cpu_s": 0.5,
            "daemon_cpu_s": None,
            "problem": "",
        }
    ]
    return run


@pytest.mark.parametrize(
    ("limited", "note"),
    [(True, "the limit is 10.0 MB"), (False, "no limit was set (its default)")],
)
def test_a_cache_over_the_hot_tier_is_marked_not_failed(limited: bool, note: str) -> None:
    name = "litdata" if limited else "litdata (default cache)"
    row = peers.median_row(name, [epochs_run(name, 20 * MB)], 1, 10 * MB, MB, limited=limited)
    assert not row.error
    assert len(row.problems) == 1
    # --small fails on any problem that does not start so.
    assert row.problems[0].startswith("its cache held up to 20.0 MB on disk: ")
    assert note in row.problems[0]
    assert peers.row_cells(row)[0] == f"{name} (!)"
    within = peers.median_row(name, [epochs_run(name, 11 * MB)], 1, 10 * MB, MB, limited=limited)
    assert within.problems == []


class Recorder:
    """Stands in for a peer's StreamingDataset and its loader: records the arguments."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    def dataset(self, *_args: Any, **kwargs: Any) -> object:
        self.kwargs = kwargs
        return object()


@pytest.mark.parametrize("limited", [True, False])
def test_litdata_passes_max_cache_size_only_when_limited(
    limited: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder()
    fake = types.SimpleNamespace(
        StreamingDataset=rec.dataset, StreamingDataLoader=lambda *a, **k: object()
    )
    monkeypatch.setitem(sys.modules, "litdata", fake)  # what importlib.import_module returns
    name = "litdata" if limited else "litdata (default cache)"
    peer = sys_litdata.LitdataPeer(spec(system=name, cache_limit=BY_NAME[name].cache_limit))
    peer.open()
    if limited:
        assert rec.kwargs["max_cache_size"] == 10 * MB
    else:
        assert "max_cache_size" not in rec.kwargs
    assert rec.kwargs["cache_dir"].startswith("/nonexistent/run/")


@pytest.mark.parametrize("limited", [True, False])
def test_mosaic_passes_cache_limit_only_when_limited_and_keeps_its_shuffle_blocks(
    limited: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder()
    monkeypatch.setattr(
        sys_mosaic, "import_streaming", lambda: types.SimpleNamespace(StreamingDataset=rec.dataset)
    )
    monkeypatch.setattr(base, "data_loader", lambda ds, s: object())
    name = "Mosaic Streaming" if limited else "Mosaic Streaming (default cache)"
    s = spec(system=name, cache_limit=BY_NAME[name].cache_limit)
    sys_mosaic.MosaicPeer(s).open()
    if limited:
        assert rec.kwargs["cache_limit"] == 10 * MB
    else:
        assert "cache_limit" not in rec.kwargs
    # From the hot tier's size in both rows: they differ in the cache limit alone.
    assert rec.kwargs["shuffle_block_size"] == sys_mosaic.shuffle_block_size(s) == 2500
