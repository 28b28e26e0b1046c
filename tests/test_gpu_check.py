"""The CPU-runnable parts of ``make gpu-check`` (bench/gpu_check.py): arguments, the
dataset and daemon set-up, the expected-bytes generator and the comparison. The GPU parts
run only on a GPU node; without CUDA the script must say so and exit 0 (a skip)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cached_client import Batch, FastLoader

from bench import gpu_check
from bench.gpu_check import (
    CheckResult,
    Dataset,
    DataSpec,
    Overlap,
    Tally,
    expected_x,
    key_ids,
    parse_key,
    sample_key,
    views,
)

SPEC = DataSpec(shards=3, per_shard=10, sample_size=1001)
SMALL = ["--shards", "2", "--samples-per-shard", "6", "--sample-size", "333", "--batch-size", "4"]
CPU = torch.device("cpu")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Dataset, str]]:
    """The check's dataset behind a real ``cached serve``, hot tier warm."""
    work = tmp_path_factory.mktemp("gpu-check")
    dataset = gpu_check.write_dataset(work / "shards", SPEC)
    with gpu_check.serve(work, dataset) as daemon:
        yield dataset, daemon.socket


def good_batch(keys: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = key_ids(keys, CPU)
    return expected_x(ids, SPEC.sample_size), ids


# -- arguments ---------------------------------------------------------------------------------


def test_arguments_defaults_and_sizes() -> None:
    args = gpu_check.parse_args([])
    assert (args.shards, args.samples_per_shard, args.batch_size, args.ring) == (16, 128, 48, 4)
    assert args.sample_size == 100003 and not args.dry_run and not args.require_cuda
    assert gpu_check.parse_args(["--bandwidth-size", "1MiB"]).bandwidth_size == 1 << 20


@pytest.mark.parametrize(
    "bad", [["--ring", "1"], ["--shards", "0"], ["--sample-size", "lots"], ["--consumer-ms", "-1"]]
)
def test_arguments_rejected(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(bad)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


# -- the generator and the comparison ----------------------------------------------------------


def test_keys_round_trip_and_reject_strangers() -> None:
    assert parse_key(sample_key(12, 345)) == (12, 345)
    for bad in ("x00001-000002", "s00001_000002", "s0001-", "s-1", "a.b"):
        with pytest.raises(ValueError, match="not a gpu-check sample key"):
            parse_key(bad)
    assert key_ids([sample_key(1, 2), sample_key(3, 4)], CPU).tolist() == [[1, 2], [3, 4]]


def test_expected_bytes_follow_the_formula() -> None:
    x = expected_x(torch.tensor([[2, 5], [0, 0]]), 300)
    assert x.dtype == torch.uint8 and x.shape == (2, 300)
    j = 299
    assert int(x[0, j]) == (7 * j + 131 * 2 + 17 * 5) % 251
    assert x[1, :4].tolist() == [0, 7, 14, 21]
    # Neighbouring samples and shards differ (a misplaced sample cannot pass).
    rows = expected_x(key_ids([sample_key(0, 0), sample_key(0, 1), sample_key(1, 0)], CPU), 64)
    assert len({bytes(r.numpy()) for r in rows}) == 3


def test_tally_passes_the_right_bytes_and_flags_a_corrupted_byte() -> None:
    keys = [sample_key(s, i) for s in range(SPEC.shards) for i in range(SPEC.per_shard)]
    tally = Tally(SPEC, CPU)
    for start in range(0, len(keys), 7):
        tally.add(keys[start : start + 7], *good_batch(keys[start : start + 7]))
    result = tally.finish(CheckResult("good", "cpu"))
    assert result.ok and result.mismatches == 0
    assert (result.batches, result.samples) == (math.ceil(SPEC.samples / 7), SPEC.samples)

    tally = Tally(SPEC, CPU)
    x, ids = good_batch(keys[:7])
    x[3, 500] ^= 1  # one byte of one sample
    tally.add(keys[:7], x, ids)
    x, ids = good_batch(keys[7:])
    ids[0, 1] += 1  # an id member that does not match its key
    tally.add(keys[7:], x, ids)
    result = tally.finish(CheckResult("corrupt", "cpu"))
    assert not result.ok and result.mismatches == 2
    assert "2 batches differ" in result.problems[0]


def test_tally_flags_missing_repeated_and_misshapen_batches() -> None:
    keys = [sample_key(0, i) for i in range(4)]
    tally = Tally(SPEC, CPU)
    tally.add(keys, *good_batch(keys))
    tally.add(keys[:1], *good_batch(keys[:1]))  # repeated
    x, ids = good_batch(keys)
    tally.add(keys, x[:, :-1], ids)  # a member one byte short
    result = tally.finish(CheckResult("partial", "cpu"))
    assert not result.ok and result.mismatches == 0
    text = "\n".join(result.problems)
    assert "x.u8 is (4, 1000)" in text
    assert f"{SPEC.samples - 4} missing, 0 unexpected, 5 repeated" in text
    assert "FAIL" in gpu_check.check_table([result])


def test_overlap_hidden_fraction() -> None:
    assert Overlap(copy_ms=10, compute_ms=10, overlapped_ms=10).hidden == 1.0  # all hidden
    assert Overlap(copy_ms=10, compute_ms=10, overlapped_ms=20).hidden == 0.0  # serialised
    assert Overlap(copy_ms=10, compute_ms=10, overlapped_ms=15).hidden == pytest.approx(0.5)
    assert Overlap(copy_ms=0, compute_ms=10, overlapped_ms=10).hidden == 0.0


# -- against the daemon ------------------------------------------------------------------------


def test_dataset_is_what_the_generator_says(served: tuple[Dataset, str]) -> None:
    dataset, _ = served
    assert [p.name for p in dataset.paths] == [f"shard-{s:05d}.tar" for s in range(SPEC.shards)]
    assert all(url.startswith("file:///") for url in dataset.urls)
    assert dataset.tar_bytes > SPEC.payload_bytes


def test_cpu_loader_reads_the_generator_bytes(served: tuple[Dataset, str]) -> None:
    dataset, socket = served
    loader = FastLoader(dataset.urls, batch_size=7, socket=socket)
    # Independently of Tally: the first batch, byte for byte.
    first = next(iter(loader))
    x, ids = views(first)
    assert first.keys == [sample_key(0, i) for i in range(7)]
    assert torch.equal(x, expected_x(key_ids(first.keys, CPU), SPEC.sample_size))
    assert ids.tolist() == [[0, i] for i in range(7)]
    # The whole epoch through the check's own code, as the GPU checks use it.
    result = gpu_check.verify_epoch("cpu", loader, SPEC, CPU, views)
    assert result.ok, result.problems
    assert (result.batches, result.samples) == (math.ceil(SPEC.samples / 7), SPEC.samples)


def test_verify_epoch_flags_a_corrupted_read(served: tuple[Dataset, str]) -> None:
    dataset, socket = served
    loader = FastLoader(dataset.urls, batch_size=8, socket=socket)

    def corrupt(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, ids = views(batch)
        x = x.clone()
        if batch.keys[0] == sample_key(0, 0):
            x[1, 0] += 1
        return x, ids

    result = gpu_check.verify_epoch("corrupt", loader, SPEC, CPU, corrupt)
    assert not result.ok and result.mismatches == 1 and result.samples == SPEC.samples
    assert "#0 (from s00000-000000): 1" in result.problems[0]


@no_cuda
def test_device_unavailable_is_checked(served: tuple[Dataset, str]) -> None:
    dataset, socket = served
    assert gpu_check.check_device_unavailable(dataset, socket, "cuda").ok


# -- the script --------------------------------------------------------------------------------


def test_dry_run_runs_the_cpu_parts(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([*SMALL, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "12 samples in 2 shards" in out
    assert "fast host (cpu)" in out and "FAIL" not in out
    assert "GPU parts skipped" in out


@no_cuda
def test_without_cuda_the_gpu_parts_are_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(SMALL) == 0  # a skip, not a failure
    out = capsys.readouterr().out
    assert 'FastLoader(device="cuda") refused' in out
    assert out.rstrip().endswith("no CUDA: GPU parts skipped")


@no_cuda
def test_require_cuda_fails_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([*SMALL, "--require-cuda"]) == 1
    assert "no CUDA: GPU parts skipped (--require-cuda: failing)" in capsys.readouterr().out


def test_script_runs_from_a_path() -> None:
    """``python bench/gpu_check.py`` (as ``make gpu-check`` runs it) finds its imports."""
    script = Path(gpu_check.__file__)
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "--dry-run" in done.stdout and "Exit status" in done.stdout
