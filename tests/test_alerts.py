"""The alert rules (deploy/prometheus/), the Grafana dashboard (deploy/grafana/) and the
PrometheusRule (deploy/k8s/monitoring/) against what a real daemon exports.

promtool evaluates the rules themselves (deploy/check/prometheus.sh). What it cannot see
is whether the names they select exist: a misspelt metric or label makes an alert that
never fires and a panel that stays empty, and no error says so. Here a real daemon (moto
S3 behind a fault-injecting proxy, a FastLoader reading as a training job, one throttled
request, one store outage) is scraped, and every metric name, label name and label value
that a rule or a panel selects is looked up in its ``/metrics``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from cached_client import FastLoader
from cached_client.jobs import JobReporter
from cached_wire.protocol import ErrorCode
from prometheus_client.parser import text_string_to_metric_families

from cached import errors
from cached.hot.tier import ShardCorrupt
from cached.stores.base import ObjectChanged
from cached.stores.retry import StoreTimeout, StoreUnavailable
from tests.daemon import daemon_config, dataset_shards, isolate_env, thread_daemon
from tests.faultproxy import FaultProxy
from tests.s3server import S3Server
from tests.test_daemon import upload

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "cached-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "cached-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "cached-dashboard.json"
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"
GENERATOR = ROOT / "deploy" / "prometheus" / "prometheusrule.py"
K8S_CHECK = ROOT / "deploy" / "check" / "k8s.py"
OBSERVABILITY = ROOT / "docs" / "observability.md"

# Names that a scrape of this daemon here cannot show, each for a stated reason:
# - `up` is Prometheus' own series for every target, never in an exposition;
# - the GPU gauges exist only where NVML answers (an NVIDIA driver and nvidia-ml-py;
#   cached/gpu.py), so they are in /metrics on a GPU node and absent here, without error.
PROMETHEUS_OWN = {"up"}
GPU_ONLY = {
    "cached_gpu_utilization_ratio",
    "cached_gpu_memory_used_bytes",
    "cached_gpu_memory_total_bytes",
}
# Label values selected that this run does not produce, and where they come from.
UNSEEN_VALUES = {
    # A daemon with every resident shard pinned answers cache_full (cached/errors.py).
    ("cached_requests_total", "result", ErrorCode.CACHE_FULL.value),
    # Misses of `cached prefetch`, which this run does not use (cached/server/reads.py).
    ("cached_misses_total", "kind", "prefetch"),
}
# Labels Prometheus attaches to every series of a target: not in the exposition. `node` is
# the ServiceMonitor's relabelling. `exported_job` is the daemon's own `job` label renamed,
# because Prometheus keeps `job` for the scrape job (checked against `job` below).
TARGET_LABELS = {"job", "instance", "node"}

# --- a small PromQL tokenizer ----------------------------------------------------------------

# Aggregation operators, binary and set operators and modifiers: identifiers that are not
# metric names even where no `(` follows them (`sum by (x) (...)`, `a and b`).
KEYWORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "and", "or", "unless", "by", "without", "on", "ignoring",
    "group_left", "group_right", "bool", "offset", "atan2", "inf", "nan",
}  # fmt: skip
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
# Label lists of grouping and vector matching: `by (job, le)`, `on (instance)`.
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")  # ranges and subqueries: durations, Grafana's variables
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")  # Grafana's $instance, ${datasource}
# A number (1e9, 0.2, a duration) is taken whole, so that its letters are no identifier.
_TOKEN = re.compile(r"\d[\w.]*(?:[eE][+-]?\d+)?|([A-Za-z_:][\w:]*)(\s*\()?")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:\\.|[^"\\])*)"')


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not functions (followed
    by `(`), keywords, label names (in `{}` and in label lists) or numbers."""
    text = _STRING.sub('""', expr)
    for pattern in (_LABEL_LIST, _MATCHERS, _RANGE, _VARIABLE):
        text = pattern.sub(" ", text)
    names = set()
    for m in _TOKEN.finditer(text):
        name, call = m.group(1), m.group(2)
        if name and not call and name not in KEYWORDS:
            names.add(name)
    return names


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each `name{...}` of an expression with its matchers: (label, operator, value)."""
    return [(m[1], _MATCHER.findall(m[2])) for m in _SELECTOR.finditer(expr)]


def test_the_tokenizer_finds_names_and_only_names() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (instance, le) (rate(a_bucket{job="x", le!="1"}'
        "[$__rate_interval]))) > 1e9 and on (job) b_total offset 5m / ignoring (kind) "
        'c:rec:ratio or absent(up{job="cached"}) unless max without (gpu) (d{k=~"a|b"}[5m:1m])'
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c:rec:ratio", "up", "d"}
    assert selectors('x{a="1", b!~"c.*"} + y') == [("x", [("a", "=", "1"), ("b", "!~", "c.*")])]


# --- what the rules and the dashboard select --------------------------------------------------


def load_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def recorded() -> set[str]:
    return {rule["record"] for rule in load_rules() if "record" in rule}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those nested in collapsed rows included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in all_panels(load_dashboard())
        for target in panel.get("targets", [])
    ]


def every_expr() -> list[tuple[str, str]]:
    """(where, expr) of every rule and every panel."""
    rules = [(rule.get("alert") or rule["record"], rule["expr"]) for rule in load_rules()]
    return rules + [(f"panel {title!r}", expr) for title, expr in dashboard_exprs()]


# --- a real daemon's /metrics -----------------------------------------------------------------


@dataclass
class Exposition:
    """What one scrape of /metrics declares and holds."""

    text: str
    declared: set[str] = field(default_factory=set)  # names of `# TYPE` lines and samples
    labels: dict[str, set[str]] = field(default_factory=dict)  # sample name -> label names
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (name, label)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        exp = cls(text)
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(maxsplit=3)
                # prometheus_client writes a counter's TYPE line with or without _total.
                base = name.removesuffix("_total")
                exp.declared |= {base + s for s in suffixes.get(kind, [""])}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                exp.declared.add(sample.name)
                exp.labels.setdefault(sample.name, set()).update(sample.labels)
                for label, value in sample.labels.items():
                    exp.values.setdefault((sample.name, label), set()).add(value)
        return exp


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def wait_for(url: str, *names: str, timeout_s: float = 20.0) -> Exposition:
    """Scrape until every name has a sample (the job reports arrive asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        exp = Exposition.parse(scrape(url))
        missing = [n for n in names if n not in exp.labels]
        if not missing:
            return exp
        if time.monotonic() > deadline:
            raise AssertionError(f"no sample of {missing} in /metrics after {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def exposition(
    s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Exposition]:
    """/metrics of a daemon after a training job read through it, one request was
    throttled and one download met a store that answered 500 until retries ran out."""
    tmp = tmp_path_factory.mktemp("alerts")
    with pytest.MonkeyPatch.context() as mp:
        isolate_env(mp)  # module scope: the autouse per-test isolation is not in force yet
        bucket = s3_server.new_bucket("alerts")
        urls = upload(s3_server, bucket, dataset_shards(8, 8, payload=2_000))
        good, throttled, failing = urls[:6], urls[6], urls[7]
        with FaultProxy.start(s3_server.endpoint_url) as proxy:
            cfg = daemon_config(tmp, proxy.endpoint_url)
            with thread_daemon(cfg) as d:
                http = d.daemon.http.url
                # A job reading two epochs: misses then hits, plans, served bytes, and the
                # job's wait, loop and batch counters from its reporter.
                loader = FastLoader(good, batch_size=4, socket=d.socket, job="alerts")
                for epoch in range(2):
                    loader.set_epoch(epoch)
                    for _ in loader:
                        time.sleep(0.001)
                # FastLoader cannot tell the batches ready; a DataLoader's reporter can. The
                # `report` op as it sends it (docs/protocol.md).
                reporter = JobReporter("alerts-dataloader", d.socket, interval_s=0.05)
                reporter.add(0.25, 1.0, 4, 3)
                reporter.flush()
                # One SlowDown (a retry, then the download succeeds).
                proxy.inject("slowdown", path=throttled.rsplit("/", 1)[1])
                for _ in FastLoader([throttled], batch_size=4, socket=d.socket, job="alerts"):
                    pass
                # 500 on every GET of one shard: each download gives up, store unavailable.
                proxy.inject("error", status=500, times=1000, path=failing.rsplit("/", 1)[1])
                with pytest.raises(Exception, match="shard-0007"):
                    for _ in FastLoader([failing], batch_size=4, socket=d.socket, job="alerts"):
                        pass
                proxy.clear()
                yield wait_for(
                    http,
                    "cached_job_loop_seconds_total",
                    "cached_job_ready_batches",
                    "cached_fetch_retries_total",
                    "cached_hits_total",
                )
                reporter.close()


# --- the checks against /metrics -------------------------------------------------------------


def test_every_selected_metric_exists(exposition: Exposition) -> None:
    known = exposition.declared | recorded() | PROMETHEUS_OWN | GPU_ONLY
    missing = []
    for where, expr in every_expr():
        names = metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        missing += [f"{where}: {name}" for name in sorted(names - known)]
    assert not missing, "selected but not in /metrics:\n" + "\n".join(missing)
    # GPU_ONLY is an exception for this machine, not a blanket one: where NVML answers,
    # the daemon exports them and they must be real.
    gpu_here = {n for n in exposition.declared if n.startswith("cached_gpu_")}
    assert not gpu_here or gpu_here >= GPU_ONLY, gpu_here


def test_every_matcher_names_a_real_label_and_value(exposition: Exposition) -> None:
    problems = []
    unchecked = set()
    skipped = recorded() | PROMETHEUS_OWN | GPU_ONLY
    for where, expr in every_expr():
        for name, matchers in selectors(expr):
            if name in skipped:
                continue
            labels = exposition.labels.get(name)
            if labels is None:  # declared (checked above) but without a sample in this run
                unchecked.add(name)
                continue
            for label, op, value in matchers:
                if label == "exported_job":
                    if "job" not in labels:
                        problems.append(f"{where}: {name} has no `job` label to export")
                    continue
                if label in TARGET_LABELS:
                    continue
                if label not in labels:
                    problems.append(f"{where}: {name} has no label {label!r} ({labels})")
                    continue
                seen = exposition.values.get((name, label), set())
                if op in ("=", "!=") and value not in seen | {
                    v for (n, lb, v) in UNSEEN_VALUES if (n, lb) == (name, label)
                }:
                    problems.append(f"{where}: {name}{{{label}={value!r}}}: never {seen}")
    assert not problems, "\n".join(problems)
    # A corrupt shard in the hot tier is the one event this run does not stage; its
    # metric's name is checked above, its label names are not.
    assert unchecked <= {"cached_corrupt_shards_total"}, unchecked


def test_the_store_error_regex_counts_a_real_outage_and_only_the_stores_faults(
    exposition: Exposition,
) -> None:
    (rule,) = [
        r for r in load_rules() if r.get("record") == "instance:cached_store_errors:ratio_rate10m"
    ]
    (regex,) = set(re.findall(r'result=~"([^"]+)"', rule["expr"]))
    failed = exposition.values[("cached_fetches_total", "result")] - {"ok"}
    assert failed, "the outage left no failed download in /metrics"
    for result in failed:  # what the 500s became: StoreUnavailable, as this test is written
        assert re.fullmatch(regex, result), (result, regex)
    # PromQL anchors =~ at both ends, as fullmatch does. The results are class names.
    stores = [StoreUnavailable, StoreTimeout, errors.FetchError, errors.FetchTimeout]
    not_stores = [
        errors.ObjectNotFound,
        errors.ObjectArchived,
        ObjectChanged,
        errors.CacheFull,
        errors.CacheError,
        errors.NotATarError,
        ShardCorrupt,
    ]
    for cls in [*stores, errors.VerifyError]:
        assert re.fullmatch(regex, cls.__name__), cls
    for name in [c.__name__ for c in not_stores] + ["OSError"]:
        assert not re.fullmatch(regex, name), name


# --- the rule file, its copy for the Operator, its documentation -------------------------------


def test_every_alert_is_labelled_annotated_and_documented() -> None:
    docs = OBSERVABILITY.read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", docs, re.MULTILINE)}
    alerts = [rule for rule in load_rules() if "alert" in rule]
    assert len(alerts) >= 5
    for rule in alerts:
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name
        path, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert path == "docs/observability.md" and anchor in anchors, (name, anchor)
        assert anchor == name.lower(), name


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_prometheusrule_is_the_rule_file() -> None:
    r = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    spec = yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]
    assert spec["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_k8s_check_rejects_a_broken_prometheusrule(tmp_path: Path) -> None:
    text = PROMETHEUS_RULE.read_text()
    broken = {
        "unknown-field.yaml": ("        for: 10m\n", "        forr: 10m\n", "forr: Extra inputs"),
        "bad-duration.yaml": ("        for: 10m\n", "        for: 10 min\n", "should match"),
    }
    for name, (old, new, _) in broken.items():
        assert old in text
        (tmp_path / name).write_text(text.replace(old, new, 1))
    r = subprocess.run(
        [sys.executable, str(K8S_CHECK), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1, r.stdout
    for name, (*_, expected) in broken.items():
        assert any(
            line.startswith("FAIL")
            and name in line
            and "PrometheusRule/cached" in line
            and expected in line
            for line in r.stdout.splitlines()
        ), (name, r.stdout)


def test_promtool_checks_and_tests_the_rules() -> None:
    """What `make deploy-lint` runs, so that `make unit` alone catches a broken rule."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (make system-deps installs Debian's prometheus)")
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        r = subprocess.run(
            ["promtool", *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert r.returncode == 0, r.stdout + r.stderr


# --- the Grafana dashboard --------------------------------------------------------------------

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def test_the_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    assert variables["instance"]["datasource"] == DATASOURCE

    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    boxes = []
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), p["title"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        boxes.append((p["title"], g))
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"] == DATASOURCE, p["title"]
    for i, (a, ga) in enumerate(boxes):
        for b, gb in boxes[i + 1 :]:
            apart = (
                ga["x"] + ga["w"] <= gb["x"]
                or gb["x"] + gb["w"] <= ga["x"]
                or ga["y"] + ga["h"] <= gb["y"]
                or gb["y"] + gb["h"] <= ga["y"]
            )
            assert apart, f"panels {a!r} and {b!r} overlap"


def test_every_panel_follows_the_instance_variable() -> None:
    for title, expr in dashboard_exprs():
        selected = {name for name, _ in selectors(expr)}
        assert metric_names(expr) <= selected, f"{title}: a bare name in {expr!r}"
        for name, matchers in selectors(expr):
            assert ("instance", "=~", "$instance") in matchers, f"{title}: {name}"


def test_promtool_parses_every_panel_expression(tmp_path: Path) -> None:
    """Prometheus' own parser on the dashboard's PromQL, with Grafana's variables given
    values: each expression as a recording rule for `promtool check rules`."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (make system-deps installs Debian's prometheus)")
    rules = [
        {
            "record": f"dashboard:expr_{i}",
            "expr": expr.replace("$__rate_interval", "1m").replace("$instance", ".*"),
        }
        for i, (_, expr) in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(
        ["promtool", "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
