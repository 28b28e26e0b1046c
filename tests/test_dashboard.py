"""The dashboard at ``/``: rendered in a real headless Chromium against a real daemon that
served a real reader, its numbers checked against ``/status``; and ``/history``.

Real parts: moto S3 behind a rate-shaping proxy (so the reader waits on the store), a
daemon in a thread, a CachedDataset read through a DataLoader with a StallMeter (so a job
reports), Debian's ``chromium`` driven over the DevTools protocol (cached_demo/browser.py).
"""

from __future__ import annotations

import asyncio
import decimal
import json
import struct
import time
import urllib.error
import urllib.request
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from cached_client import CachedDataset
from cached_client.device import StallMeter
from torch.utils.data import DataLoader

from cached.config import format_size
from cached.history import History, sample_of
from cached.http import DASHBOARD_FILES
from cached_demo.browser import find_chromium, headless
from tests.daemon import daemon_config, dataset_shards, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import upload
from tests.test_jobs import as_list, get_json, payload_bytes, until
from tests.test_logs import SECRET, TOKEN

CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium on PATH: `make test` installs it (deploy/check/system-deps.sh, as "
    "root); or `apt-get install chromium`",
)

SVG_NS = b"http://www.w3.org/2000/svg"
# What /dashboard/ serves: the page's files, not the page itself (it is at /).
ASSETS = [name for name in DASHBOARD_FILES if name != "index.html"]
# A job name a client could send: markup in it must show as text and never become markup.
JOB = 'train <img src="x"> & "co"'

# Everything the page shows, in one evaluation: each [id][data-value] element's raw value
# and text, the job table's cells, the verdict, what the charts drew, the page's raw status.
READ_PAGE = """(() => {
  const d = window.cachedDashboard;
  const values = {};
  for (const el of document.querySelectorAll("[id][data-value]")) {
    values[el.id] = {value: el.dataset.value, text: el.textContent};
  }
  const jobs = {};
  for (const tr of document.querySelectorAll("#jobs tr")) {
    const row = {};
    for (const td of tr.querySelectorAll("td")) {
      row[td.dataset.field] = {value: td.dataset.value, text: td.textContent};
    }
    jobs[tr.dataset.job] = row;
  }
  const series = {};
  for (const g of document.querySelectorAll("svg[id] g[data-series]")) {
    series[g.closest("svg").id + ":" + g.dataset.series] = Number(g.dataset.points);
  }
  const v = document.getElementById("verdict");
  return {
    renders: d.renders, status: d.status, history: d.history, values, jobs, series,
    verdict: {state: v.dataset.state, cause: v.dataset.cause, job: v.dataset.job,
              text: document.getElementById("verdict-text").textContent,
              split: d.verdict.split},
    images: document.querySelectorAll("img").length,
    hotBar: document.getElementById("hot-bar").style.width,
  };
})()"""


# -- the page's formatting, in Python (cached/dashboard/dashboard.js) -------------------------


def fmt_int(n: float) -> str:
    return f"{round(n):,}"


def to_fixed(x: float, digits: int) -> str:
    """JavaScript's ``x.toFixed(digits)`` for x >= 0: an exact tie (97.25 is one in binary)
    rounds up, where Python's format rounds it to even (97.2)."""
    exact = decimal.Decimal(x)  # the double's exact value: a tie only where it is one
    return str(exact.quantize(decimal.Decimal(1).scaleb(-digits), decimal.ROUND_HALF_UP))


def fmt_pct(f: float) -> str:
    return f"{to_fixed(100 * f, 1)}%"


def fmt_secs(s: float) -> str:
    if s < 120:
        return f"{to_fixed(s, 1)} s"
    return f"{to_fixed(s / 60, 1)} min" if s < 7200 else f"{to_fixed(s / 3600, 1)} h"


def raw(value: str) -> float | None:
    """A data-value attribute: "" is none."""
    return None if value == "" else float(value)


def recent_wait(job: dict[str, Any], samples: list[dict[str, Any]]) -> float | None:
    """The verdict's rule (docs/observability.md): the job's wait / loop since the oldest
    sample within 60 s of the newest (since its start when that sample predates it)."""
    newest = samples[-1]["t"]
    base = next(s for s in samples if s["t"] >= newest - 60)
    before = base["jobs"].get(job["job"], {"wait_s": 0.0, "loop_s": 0.0})
    loop = job["loop_s"] - before["loop_s"]
    wait = job["wait_s"] - before["wait_s"]
    return min(1.0, max(0.0, wait / loop)) if loop > 0 else None


def wait_by_cause(name: str, status: dict[str, Any], samples: list[dict[str, Any]]) -> list[float]:
    """The verdict's rule: the job's wait over the last minute, [in intervals in which
    demand misses rose (the store's), in the others (the node's)], up to /status now."""
    newest = samples[-1]["t"]
    start = next(i for i, s in enumerate(samples) if s["t"] >= newest - 60)
    now = {
        "demand_misses": status["counters"]["demand_misses"],
        "jobs": {job["job"]: job for job in status["jobs"]},
    }
    points = [*samples[start:], now]
    split = [0.0, 0.0]
    for a, b in pairwise(points):
        if name in b["jobs"]:
            wait = b["jobs"][name]["wait_s"] - a["jobs"].get(name, {"wait_s": 0.0})["wait_s"]
            split[0 if b["demand_misses"] > a["demand_misses"] else 1] += wait
    return split


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def fetch(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


# -- the acceptance run -----------------------------------------------------------------------


@needs_chromium
def test_the_dashboard_renders_what_status_reports_in_headless_chromium(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A distinctive secret: it must appear in none of what the daemon serves.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    bucket = s3_server.new_bucket("dashboard")
    shards = dataset_shards(6, 16, payload=20_000)  # 1.9 MB
    urls = upload(s3_server, bucket, shards)
    with FaultProxy.start(s3_server.endpoint_url) as link:
        # A slow store: the reader's loop waits on it, so the job is input-bound and the
        # store is the cause (demand misses), which the verdict must say.
        link.rate_bps = 1_000_000
        with thread_daemon(daemon_config(tmp_path, link.endpoint_url)) as d:
            http = d.daemon.http.url
            ds = CachedDataset(urls, socket=d.socket, job=JOB)
            meter = StallMeter()
            read = 0
            for batch in meter.wrap(DataLoader(ds, batch_size=8, collate_fn=as_list)):
                read += payload_bytes(batch)
                time.sleep(0.005)  # the step
            assert meter.fraction > 0.5, meter.fraction  # the slow store made it wait

            # A stable state to compare: the job's last report is in, and a history sample
            # was taken after it (the reader is done, so nothing moves any more).
            def settled() -> dict[str, Any] | None:
                status = get_json(f"{http}/status")
                jobs = status["jobs"]
                if not (jobs and jobs[0]["batches"] == meter.batches):
                    return None
                last = get_json(f"{http}/history")["samples"][-1]
                done = last["jobs"].get(JOB, {}).get("batches") == meter.batches
                same = all(last[k] == status["counters"][k] for k in ("hits", "served_bytes"))
                return status if done and same else None

            before = until(settled, what="the last report, then a history sample after it")
            page = asyncio.run(read_the_page(http, tmp_path / "dashboard.png"))
            after = get_json(f"{http}/status")
            served = {p: fetch(f"{http}{p}") for p in ("/", "/history", "/status")}
            assets = {name: fetch(f"{http}/dashboard/{name}") for name in ASSETS}

    # The browser saw no error at all: no console error, no exception, no failed or
    # blocked load (the Content-Security-Policy allows this address only).
    assert page["errors"] == [], page["errors"]
    # The page rendered a /status that agrees with the test's own, before and after, on
    # everything that no longer moves (not uptime, idle times, streams, pins).
    shown = page["status"]
    for status in (before, after):
        assert shown["counters"] == status["counters"]
        for key in ("used_bytes", "capacity_bytes", "shards"):
            assert shown["hot"][key] == status["hot"][key]
        assert strip_moving(shown["jobs"]) == strip_moving(status["jobs"])
        assert shown["store"]["reachable"] and status["store"]["reachable"]
    c = shown["counters"]
    assert c["served_bytes"] == read and c["fetched_bytes"] == sum(map(len, shards))
    assert c["hits"] + c["misses"] >= 6 and c["demand_misses"] > 0

    # Each number on the page: its raw value is the status's, its text that value rendered.
    values = page["values"]
    hot = shown["hot"]

    def check(element: str, value: float | None, text: str) -> None:
        got = values[element]
        assert raw(got["value"]) == value, (element, got, value)
        assert got["text"] == text, (element, got, text)

    check("hot-used", hot["used_bytes"], format_size(hot["used_bytes"]))
    check("hot-capacity", hot["capacity_bytes"], format_size(hot["capacity_bytes"]))
    fill = hot["used_bytes"] / hot["capacity_bytes"]
    check("hot-fill", fill, fmt_pct(fill))
    assert float(page["hotBar"].removesuffix("%")) == pytest.approx(100 * fill, abs=0.005)
    check("hot-shards", hot["shards"], fmt_int(hot["shards"]))
    check("hot-pinned", hot["pinned_shards"], fmt_int(hot["pinned_shards"]))
    check("hot-fetching", hot["fetching_shards"], fmt_int(hot["fetching_shards"]))
    rate = c["hits"] / (c["hits"] + c["misses"])
    check("hit-rate", rate, fmt_pct(rate))
    check("hits", c["hits"], fmt_int(c["hits"]))
    check("misses", c["misses"], fmt_int(c["misses"]))
    check("demand-misses", c["demand_misses"], fmt_int(c["demand_misses"]))
    check("fetched-bytes", c["fetched_bytes"], format_size(c["fetched_bytes"]))
    check("served-bytes", c["served_bytes"], format_size(c["served_bytes"]))
    check("served-samples", c["served_samples"], fmt_int(c["served_samples"]))
    lead = shown["prefetch"]["lead_s"]
    check("lead", lead, "all resident" if lead is None else fmt_secs(lead))
    assert values["store"] == {"value": "reachable", "text": "reachable"}
    check("uptime", shown["uptime_s"], fmt_secs(shown["uptime_s"]))
    check("streams", shown["streams"], fmt_int(shown["streams"]))
    # The throughput now: the rate over the newest history interval the page had.
    samples = page["history"]["samples"]
    assert len(samples) >= 2 and page["history"]["interval_s"] == 2.0
    a, b = samples[-2], samples[-1]
    for element, key in (("fetch-rate", "fetched_bytes"), ("serve-rate", "served_bytes")):
        per_s = max(0.0, (b[key] - a[key]) / (b["t"] - a["t"]))
        check(element, per_s, f"{format_size(per_s)}/s")

    # The job's row: its name as text (no markup made of it), its figures as /status has.
    (job,) = shown["jobs"]
    assert job["job"] == JOB and page["images"] == 0
    row = page["jobs"][JOB]
    assert row["job"] == {"value": JOB, "text": JOB}
    cells = {
        "wait_fraction": (job["wait_fraction"], fmt_pct(job["wait_fraction"])),
        "batches": (job["batches"], fmt_int(job["batches"])),
        "reporters": (job["reporters"], fmt_int(job["reporters"])),
        "plans": (job["plans"], fmt_int(job["plans"])),
        # A loader without workers cannot tell how many batches it holds ready: none, a dash.
        "ready": (None, "\u2013"),
    }
    assert job["ready"] is None
    for field, (value, text) in cells.items():
        assert raw(row[field]["value"]) == value and row[field]["text"] == text, (field, row)
    assert job["batches"] == meter.batches and job["reporters"] == 1
    # The last minute's wait, by the documented rule, from what the page had.
    recent = recent_wait(job, samples)
    assert recent is not None and recent > 0.5
    assert raw(row["recent_wait_fraction"]["value"]) == pytest.approx(recent, abs=1e-12)
    assert row["recent_wait_fraction"]["text"] == fmt_pct(recent)

    # The verdict in five seconds: this job is input-bound, and the store is the cause: the
    # wait came while readers waited for shards from it.
    verdict = page["verdict"]
    assert verdict["state"] == "input-bound" and verdict["cause"] == "store", verdict
    store, node = wait_by_cause(JOB, shown, samples)
    assert verdict["split"] == {"store": pytest.approx(store), "node": pytest.approx(node)}
    assert store > node and store + node == pytest.approx(job["wait_s"], abs=0.002)
    assert verdict["job"] == JOB and JOB in verdict["text"] and "store" in verdict["text"]
    # The charts drew the history: throughput per interval, and the job's wait.
    assert page["series"]["chart-throughput:fetch"] == len(samples) - 1
    assert page["series"]["chart-throughput:serve"] == len(samples) - 1
    assert page["series"][f"chart-jobs:{JOB}"] >= 1

    # The screenshot, in the test's temporary directory: a real PNG of the page.
    shot = tmp_path / "dashboard.png"
    assert png_size(shot.read_bytes()) == (1280, 900)
    assert shot.stat().st_size > 20_000, shot.stat().st_size

    # What is served: the page offline and locked to this address, and no secret anywhere.
    code, headers, _ = served["/"]
    assert code == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for name, (code, _, asset) in [("/", served["/"]), *assets.items()]:
        # No URL but relative ones (the SVG namespace is a name, not a load).
        assert code == 200 and b"://" not in asset.replace(SVG_NS, b""), name
    for path, (code, _, text) in served.items():
        assert code == 200, path
        for secret in (SECRET, TOKEN, SECRET[:16], TOKEN[:16]):
            assert secret.encode() not in text, path


def strip_moving(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A job's figures without those that move while it is idle."""
    return [{k: v for k, v in job.items() if k != "idle_s"} for job in jobs]


async def read_the_page(http: str, shot: Path) -> dict[str, Any]:
    """Open the dashboard, wait until it rendered a history with two samples or more, and
    read it; save a screenshot at ``shot``."""
    async with headless() as page:
        await page.goto(f"{http}/")
        await page.wait_for(
            "window.cachedDashboard && cachedDashboard.renders > 0 && "
            "cachedDashboard.history.samples.length >= 2"
        )
        got: dict[str, Any] = await page.evaluate(READ_PAGE)
        png = await page.screenshot()
        await asyncio.to_thread(shot.write_bytes, png)
        # Errors reported while it rendered, and any a second later (the next poll).
        await asyncio.sleep(1.0)
        got["errors"] = list(page.errors)
        return got


# -- /history and the routes, without a browser -----------------------------------------------


def test_history_keeps_the_last_minutes_of_cumulative_samples() -> None:
    clock = [1000.0]
    status: dict[str, Any] = {
        "hot": {"used_bytes": 10, "capacity_bytes": 100},
        "counters": {"hits": 1.0, "misses": 2.0, "demand_misses": 1.0, "fetched_bytes": 5.0},
        "prefetch": {"lead_s": None},
        "store": {"reachable": False},
        # No "jobs" key: a daemon without the job board reads as no job.
    }
    history = History(lambda: status, interval_s=2.0, keep_s=10.0, clock=lambda: clock[0])
    for _ in range(20):
        history.sample()
        clock[0] += 2.0
    snap = history.snapshot()
    assert snap["interval_s"] == 2.0 and snap["keep_s"] == 10.0
    # 10 s at 2 s: both ends of the window, 6 samples, the newest last.
    assert [s["t"] for s in snap["samples"]] == [1028.0, 1030.0, 1032.0, 1034.0, 1036.0, 1038.0]
    first = snap["samples"][0]
    assert first["jobs"] == {} and first["store_reachable"] is False and first["lead_s"] is None
    assert first["served_bytes"] == 0.0 and first["hot_used_bytes"] == 10
    json.dumps(snap)  # JSON-able
    status["jobs"] = [{"job": "a", "wait_s": 1.5, "loop_s": 3.0, "batches": 7, "ready": 2}]
    assert sample_of(status, 0.0)["jobs"] == {"a": {"wait_s": 1.5, "loop_s": 3.0, "batches": 7}}


async def test_history_survives_a_failing_status() -> None:
    calls = [0]
    enough = asyncio.Event()

    def status() -> dict[str, Any]:
        calls[0] += 1
        if calls[0] == 4:
            enough.set()
        if calls[0] == 2:
            raise RuntimeError("a status that fails once")
        return {"counters": {"hits": float(calls[0])}}

    history = History(status, interval_s=0.01, keep_s=1.0)
    task = asyncio.create_task(history.run())
    await asyncio.wait_for(enough.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    hits = [s["hits"] for s in history.snapshot()["samples"]]
    assert hits[:2] == [1.0, 3.0]  # the failed sample is skipped; the loop went on


def test_the_page_and_its_assets_are_served_and_nothing_else(
    s3_server: S3Server, tmp_path: Path
) -> None:
    with thread_daemon(daemon_config(tmp_path, s3_server.endpoint_url)) as d:
        http = d.daemon.http.url
        page = fetch(f"{http}/")
        assets = {name: fetch(f"{http}/dashboard/{name}") for name in ASSETS}
        missing = [
            fetch(f"{http}/dashboard/{p}")[0]
            for p in ("index.html", "nope.js", "..%2Fhttp.py", "..%2F..%2Fpyproject.toml", "")
        ]
        history = until(
            lambda: (h := get_json(f"{http}/history"))["samples"] and h, what="a sample"
        )
    code, headers, body = page
    assert code == 200 and b'src="dashboard/dashboard.js"' in body
    assert headers["Content-Security-Policy"].startswith("default-src 'self'")
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert assets["dashboard.js"][1]["Content-Type"] == "text/javascript; charset=utf-8"
    assert assets["dashboard.css"][1]["Content-Type"] == "text/css; charset=utf-8"
    assert all(code == 200 for code, _, _ in assets.values())
    assert missing == [404] * 5
    sample = history["samples"][0]
    assert set(sample) == {
        "t",
        "hot_used_bytes",
        "hot_capacity_bytes",
        "hits",
        "misses",
        "demand_misses",
        "fetched_bytes",
        "served_bytes",
        "served_samples",
        "lead_s",
        "store_reachable",
        "jobs",
    }
    assert sample["hot_capacity_bytes"] == 1 << 30 and sample["store_reachable"] is True
