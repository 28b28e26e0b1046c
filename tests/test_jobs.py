"""The trainers' side in the daemon: jobs report their loops' wait for data, and the
daemon's ``/metrics``, ``/status`` and ``cached status`` show it per job.

Real parts: moto S3 (behind a rate-shaping proxy where waits must happen), real daemons,
DataLoaders with worker processes, training processes as real subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cached_client import CachedDataset, FastLoader
from cached_client.device import DeviceLoader, StallMeter
from cached_client.errors import RemoteError
from cached_client.jobs import JobReporter, job_name, timed
from cached_client.transport import Connection
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from torch.utils.data import DataLoader

from cached import gpu
from cached.cli import main as cached_main
from cached.jobs import JobBoard, Report
from cached.metrics import Metrics
from tests.daemon import daemon_config, dataset_shards, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_logs import SECRET, TOKEN

# -- helpers ----------------------------------------------------------------------------------


def scrape(http: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def job_value(samples: dict[Any, float], name: str, job: str) -> float | None:
    return samples.get((name, (("job", job),)))


def total(samples: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def until(check: Callable[[], Any], timeout_s: float = 15.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.1)


def payload_bytes(samples: list[dict[str, Any]]) -> int:
    return sum(len(v) for s in samples for k, v in s.items() if not k.startswith("__"))


def as_list(batch: list[Any]) -> list[Any]:
    return batch


# -- the acceptance run -----------------------------------------------------------------------


def test_metrics_during_a_real_run_move_as_the_run_implies(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A distinctive secret: it must appear in none of what the daemon shows.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    bucket = s3_server.new_bucket("acceptance")
    urls = upload(s3_server, bucket, dataset_shards(12, 16, payload=20_000))  # 3.9 MB
    with FaultProxy.start(s3_server.endpoint_url) as link:
        # A slow store: the first epoch waits on it; the second is all hot-tier hits.
        link.rate_bps = 3_000_000
        cfg = daemon_config(tmp_path, link.endpoint_url)
        with thread_daemon(cfg) as d:
            http = d.daemon.http.url
            ds = CachedDataset(urls, socket=d.socket, job="acceptance")
            loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=as_list)
            scrapes: list[dict[Any, float]] = []
            stop = threading.Event()

            def scraper() -> None:
                while not stop.wait(0.5):
                    scrapes.append(scrape(http))

            watcher = threading.Thread(target=scraper)
            watcher.start()
            meter = StallMeter()
            read = 0
            misses: list[float] = []
            try:
                for epoch in range(2):
                    ds.set_epoch(epoch)
                    for batch in meter.wrap(loader):
                        read += payload_bytes(batch)
                        time.sleep(0.06)  # the step
                    misses.append(total(scrape(http), "cached_misses_total"))
            finally:
                stop.set()
                watcher.join()
            # The end-of-loop report carries the last batch.
            final = until(
                lambda: (
                    (s := scrape(http))
                    and job_value(s, "cached_job_batches_total", "acceptance") == meter.batches
                    and s
                ),
                what="the final report",
            )
            status = get_json(f"{http}/status")
            texts = [
                urllib.request.urlopen(f"{http}{p}", timeout=10).read().decode()
                for p in ("/metrics", "/status")
            ]

    assert meter.batches == 2 * 24 and read == 2 * 12 * 16 * (20_000 + 1)  # two epochs
    # Bytes served are the bytes the client read.
    assert total(final, "cached_served_bytes_total") == read
    # The job's wait, as the daemon counts it, is the client's own StallMeter's.
    waited = job_value(final, "cached_job_wait_seconds_total", "acceptance")
    looped = job_value(final, "cached_job_loop_seconds_total", "acceptance")
    assert waited is not None and looped is not None
    assert meter.wait_s > 0.3, meter.wait_s  # the slow store really made the loop wait
    assert abs(waited - meter.wait_s) <= 0.1 * meter.wait_s, (waited, meter.wait_s)
    assert abs(looped - meter.total_s) <= 0.1 * meter.total_s, (looped, meter.total_s)
    # The first epoch missed every shard (opens ahead count too); the second fits in the
    # hot tier: no miss at all.
    assert misses[0] >= 12 and misses[1] == misses[0], misses
    # The counters moved during the run, not only at its end, and never went back.
    seen = [job_value(s, "cached_job_batches_total", "acceptance") or 0.0 for s in scrapes]
    assert any(0 < b < meter.batches for b in seen), seen
    assert seen == sorted(seen)
    # /status shows the job's share of loop time spent waiting, next to its plans.
    (job,) = status["jobs"]
    assert job["job"] == "acceptance" and job["batches"] == meter.batches
    assert job["wait_fraction"] == pytest.approx(waited / looped, abs=0.002)
    assert job["plans"] == 2  # one per DataLoader worker
    # Every iteration of a worker is a stream of its own (2 workers x 2 epochs), all of
    # them reading within the last 10 s, though each read takes a whole shard at once.
    assert status["streams"] == 4
    assert total(final, "cached_jobs") == 1
    assert total(final, "cached_ready") == 1
    for text in texts:
        assert SECRET not in text and TOKEN not in text
        assert SECRET[:16] not in text and TOKEN[:16] not in text


# -- who is a job -----------------------------------------------------------------------------

RANK = """
import sys, time
from cached_client import FastLoader
loader = FastLoader(sys.argv[2:], batch_size=4, socket=sys.argv[1], rank={rank}, world_size=2)
for batch in loader:
    time.sleep(0.01)
print(len(loader.job), loader.job)
"""


def test_the_ranks_of_one_launch_on_a_node_are_one_job(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(4, 8))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        # As torchrun starts them: one process per rank, the same rendezvous in the env.
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
        env.pop("CACHED_JOB", None)
        ranks = [
            subprocess.run(
                [sys.executable, "-c", RANK.format(rank=r), d.socket, *urls],
                env=env,
                check=False,
                capture_output=True,
                text=True,
                timeout=60,
            )
            for r in range(2)
        ]
        for done in ranks:
            assert done.returncode == 0, done.stderr
        names = {done.stdout.split()[1] for done in ranks}
        assert len(names) == 1  # the same generated name in both
        (name,) = names

        def jobs() -> list[dict[str, Any]]:
            return [j for j in d.call(d.daemon.status)["jobs"] if j["batches"] == 8]

        (job,) = until(jobs, what="both ranks' reports")  # 2 ranks x 16 samples / 4
        assert job["job"] == name and job["reporters"] == 2


def test_job_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHED_JOB", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-1")
    generated = job_name()
    assert generated == job_name() and generated != "run-1"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-2")
    assert job_name() != generated  # another launch, another job
    monkeypatch.setenv("CACHED_JOB", "from-env")
    assert job_name() == "from-env" and job_name("given") == "given"
    with pytest.raises(ValueError, match="at most 128"):
        job_name("x" * 129)
    with pytest.raises(ValueError, match="printable"):
        job_name("bad\nname")


# -- counted once, whatever wraps what ------------------------------------------------------


def test_a_loop_measured_twice_is_counted_once(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(4, 8))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        fast = FastLoader(urls, batch_size=4, socket=d.socket, job="nested")
        # The FastLoader measures itself, DeviceLoader measures it, StallMeter measures
        # that: the outermost one is the training loop's wait, reported once.
        meter = StallMeter()
        for _ in meter.wrap(DeviceLoader(fast, "cpu")):
            time.sleep(0.01)
        (job,) = until(
            lambda: [j for j in d.call(d.daemon.status)["jobs"] if j["batches"] == 8],
            what="the job's report",
        )
        assert job["job"] == "nested" and job["reporters"] == 1
        assert job["loop_s"] == pytest.approx(meter.total_s, rel=0.02)
        # A DataLoader over a CachedDataset wrapped in a DeviceLoader: that dataset's job.
        ds = CachedDataset(urls, socket=d.socket, job="device")
        for _ in DeviceLoader(
            DataLoader(ds, batch_size=8, num_workers=1, collate_fn=as_list), "cpu"
        ):
            pass
        until(
            lambda: [j for j in d.call(d.daemon.status)["jobs"] if j["job"] == "device"],
            what="the DeviceLoader's report",
        )


def test_stall_meter_without_a_cached_loader_reports_only_when_given_a_job(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        # The default socket is this daemon's: a report from the meter given no job would
        # come here (and be seen), not go to /run/cached/cached.sock.
        monkeypatch.setenv("CACHED_SOCKET", d.socket)
        quiet = StallMeter()
        list(quiet.wrap(range(3)))
        named = StallMeter(job="plain")  # at the default socket too
        list(named.wrap(range(5)))
        until(
            lambda: any(j["job"] == "plain" for j in d.call(d.daemon.status)["jobs"]),
            what="the named job",
        )
        # The quiet meter's loop ended first; give a report of it, were there one, a
        # moment more to arrive all the same.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            jobs = d.call(d.daemon.status)["jobs"]
            assert [(j["job"], j["batches"]) for j in jobs] == [("plain", 5)], jobs
            time.sleep(0.1)


# -- what the daemon accepts ------------------------------------------------------------------


def report(conn: Connection, **fields: Any) -> None:
    base = {"op": "report", "job": "j", "reporter": "r1", "wait_s": 1.0, "loop_s": 2.0}
    conn.request({**base, "batches": 3, "ready": None, **fields})


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"job": ""}, "'job'"),
        ({"job": "x" * 129}, "'job'"),
        ({"job": 7}, "'job'"),
        ({"job": "a\x00b"}, "'job'"),
        ({"reporter": None}, "'reporter'"),
        ({"wait_s": -1}, "'wait_s'"),
        ({"loop_s": "1"}, "'loop_s'"),
        ({"wait_s": float("nan")}, "'wait_s'"),
        ({"batches": 1.5}, "'batches'"),
        ({"batches": True}, "'batches'"),
        ({"ready": -2}, "'ready'"),
    ],
)
def test_a_malformed_report_is_a_bad_request(
    s3_server: S3Server, tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        with pytest.raises(RemoteError, match=named) as caught:
            report(conn, **fields)
        assert caught.value.code == "bad_request"
        report(conn)  # and the daemon goes on
        assert d.call(d.daemon.status)["jobs"][0]["batches"] == 3


def test_jobs_are_capped_and_lapse_with_their_series(s3_server: S3Server, tmp_path: Path) -> None:
    cfg = daemon_config(
        tmp_path, s3_server.endpoint_url, **{"server.max_jobs": 2, "server.job_timeout_s": 1.0}
    )
    with thread_daemon(cfg) as d:
        http = d.daemon.http.url
        conn = Connection(d.socket)
        report(conn, job="a")
        report(conn, job="b", reporter="r2")
        with pytest.raises(RemoteError, match=r"2 jobs, its cap") as caught:
            report(conn, job="c", reporter="r3")
        assert caught.value.code == "limit_exceeded"
        assert job_value(scrape(http), "cached_job_wait_seconds_total", "a") == 1.0
        # Silent for the timeout: dropped, series and all; room for another job again.
        until(lambda: not d.call(d.daemon.status)["jobs"], what="the jobs to lapse")
        samples = scrape(http)
        assert job_value(samples, "cached_job_wait_seconds_total", "a") is None
        assert total(samples, "cached_jobs") == 0
        report(conn, job="c", reporter="r3")


def test_the_reporter_sends_in_the_background_and_heeds_refusals(
    s3_server: S3Server, tmp_path: Path
) -> None:
    cfg = daemon_config(tmp_path, s3_server.endpoint_url, **{"server.max_jobs": 1})
    with thread_daemon(cfg) as d:
        Connection(d.socket).request(
            {
                "op": "report",
                "job": "first",
                "reporter": "x",
                "wait_s": 0,
                "loop_s": 0,
                "batches": 0,
            }
        )
        refused = JobReporter("second", d.socket, interval_s=0.05)
        refused.add(0.5, 1.0, 1, 2)
        until(lambda: "limit_exceeded" in refused._warned, what="the refusal")
        refused.close()
        kept = JobReporter("first", d.socket, interval_s=0.05)
        kept.add(0.25, 1.0, 4, 3)
        until(lambda: d.call(d.daemon.status)["jobs"][0]["batches"] == 4, what="the report")
        (job,) = d.call(d.daemon.status)["jobs"]
        assert job["wait_s"] == 0.25 and job["ready"] == 3 and job["reporters"] == 2
        kept.close()


# -- the board's arithmetic -------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def board(timeout_s: float = 60.0) -> tuple[JobBoard, Metrics, Clock]:
    metrics, clock = Metrics(CollectorRegistry()), Clock()
    return JobBoard(metrics, timeout_s=timeout_s, clock=clock), metrics, clock


def value(metrics: Metrics, name: str, job: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"job": job})


def test_reports_add_what_grew_and_a_lost_one_loses_nothing() -> None:
    jobs, m, clock = board()
    r = Report("j", "p1", wait_s=1.0, loop_s=4.0, batches=10, ready=2)
    jobs.report(r)
    # The next report is lost; the one after carries the totals.
    jobs.report(Report("j", "p1", wait_s=3.0, loop_s=10.0, batches=30, ready=1))
    jobs.report(Report("j", "p2", wait_s=1.0, loop_s=10.0, batches=30, ready=4))
    assert value(m, "cached_job_wait_seconds_total", "j") == 4.0
    assert value(m, "cached_job_loop_seconds_total", "j") == 20.0
    assert value(m, "cached_job_batches_total", "j") == 60
    assert value(m, "cached_job_ready_batches", "j") == 5
    (s,) = jobs.summary({"j": 3})
    assert s["wait_fraction"] == 0.2 and s["plans"] == 3 and s["reporters"] == 2
    # A process that started over (smaller totals) counts from zero again.
    jobs.report(Report("j", "p2", wait_s=0.5, loop_s=1.0, batches=2, ready=None))
    assert value(m, "cached_job_batches_total", "j") == 62
    # One process goes quiet: the ready gauge is the other's; then the job is dropped.
    clock.now += 50
    jobs.report(Report("j", "p2", wait_s=0.5, loop_s=2.0, batches=3, ready=None))
    clock.now += 20
    jobs.expire()
    assert value(m, "cached_job_ready_batches", "j") is None  # p2 never said
    assert jobs.summary()[0]["reporters"] == 1
    clock.now += 61
    jobs.expire()
    assert jobs.summary() == [] and value(m, "cached_job_batches_total", "j") is None


def test_a_restarted_daemon_does_not_count_a_process_past_twice() -> None:
    jobs, m, _ = board()
    # A process that started counting before this daemon did (the daemon restarted):
    # its totals were counted by the previous instance. Its first report is a baseline.
    jobs.report(Report("j", "old", 5.0, 50.0, 100, None, started=jobs.started - 30))
    assert value(m, "cached_job_batches_total", "j") == 0
    jobs.report(Report("j", "old", 6.0, 60.0, 120, None, started=jobs.started - 30))
    assert value(m, "cached_job_batches_total", "j") == 20
    # One that started after the daemon: all of its first report is new.
    jobs.report(Report("j", "new", 1.0, 2.0, 7, None, started=jobs.started + 1))
    assert value(m, "cached_job_batches_total", "j") == 27


def test_timed_loops_add_up_to_the_whole_iteration() -> None:
    got: list[tuple[float, float, int]] = []

    def slow() -> Any:
        for i in range(3):
            time.sleep(0.02)
            yield i

    start = time.perf_counter()
    for _ in timed(slow(), lambda w, loop, b, _r: got.append((w, loop, b))):
        time.sleep(0.01)
    elapsed = time.perf_counter() - start
    assert [b for _, _, b in got] == [1, 1, 1, 0]
    assert sum(w for w, _, _ in got) == pytest.approx(0.06, abs=0.015)
    assert sum(loop for _, loop, _ in got) == pytest.approx(elapsed, abs=0.005)
    # Left early: the time after the last item still counts as loop time.
    got.clear()
    for _ in timed(slow(), lambda w, loop, b, _r: got.append((w, loop, b))):
        time.sleep(0.03)
        break
    assert got[-1][0] == 0 and got[-1][1] >= 0.03


# -- cached status, GPU metrics ---------------------------------------------------------------


def test_cached_status_shows_each_jobs_wait_next_to_its_plans(
    s3_server: S3Server, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    urls = upload(s3_server, bucket, dataset_shards(2, 4))
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        conn = Connection(d.socket)
        conn.request({"op": "plan", "plan": "p", "urls": urls, "job": "train"})
        report(conn, job="train", wait_s=25.0, loop_s=100.0, batches=500, ready=3)
        with pytest.raises(SystemExit) as done:
            cached_main(["status", "--socket", d.socket])
        assert done.value.code == 0
    out = capsys.readouterr().out
    assert "plan p (job train): shard 0 of 2" in out
    assert (
        "job train: waiting 25.0% of 100 s of loop, 500 batches, 3 ready, 1 processes, 1 plans"
        in out
    )


def test_no_gpu_no_gpu_series_and_no_error() -> None:
    if gpu.nvml() is not None:
        pytest.skip("this machine has an NVIDIA driver (make gpu-check covers the GPU side)")
    text = Metrics(CollectorRegistry()).registry
    names = {s.name for family in text.collect() for s in family.samples}
    assert not any(n.startswith("cached_gpu_") for n in names)
    assert "process_cpu_seconds_total" in names


class FakeNVML:
    """NVML's answers for two GPUs, for the arithmetic only: the real library is checked
    on a GPU node by make gpu-check."""

    class Util:
        gpu = 87

    class Memory:
        used, total = 40 << 30, 141 << 30

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, _h: int) -> Any:
        return self.Util()

    def nvmlDeviceGetMemoryInfo(self, _h: int) -> Any:
        return self.Memory()


def test_gpu_series_are_ratios_and_bytes_per_gpu() -> None:
    registry = CollectorRegistry()
    registry.register(gpu.GpuCollector(FakeNVML()))
    assert registry.get_sample_value("cached_gpu_utilization_ratio", {"gpu": "1"}) == 0.87
    assert registry.get_sample_value("cached_gpu_memory_total_bytes", {"gpu": "0"}) == 141 << 30
    # A driver that fails mid-run: no GPU series, no error.
    broken = FakeNVML()
    broken.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(RuntimeError("gone"))  # type: ignore[method-assign]
    registry = CollectorRegistry()
    registry.register(gpu.GpuCollector(broken))
    assert registry.get_sample_value("cached_gpu_utilization_ratio", {"gpu": "0"}) is None
