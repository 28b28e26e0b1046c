"""deploy/check/k8s.py (``make deploy-lint``) passes the shipped Kubernetes manifests and
fails on each kind of defect it is there to catch, naming the file and the error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "deploy" / "check" / "k8s.py"
K8S = ROOT / "deploy" / "k8s"

# A broken copy of a shipped file: (shipped file, text in it, replacement, expected error).
BROKEN = {
    "unknown-field.yaml": (
        "daemonset.yaml",
        "          image: cached:0.1.0\n",
        "          imagee: cached:0.1.0\n",
        "DaemonSet/cached: spec.template.spec.initContainers.0: Additional properties are not "
        "allowed ('imagee' was unexpected)",
    ),
    "wrong-type.yaml": (
        "daemonset.yaml",
        "        runAsUser: 10001\n",
        '        runAsUser: "10001"\n',
        "DaemonSet/cached: spec.template.spec.securityContext.runAsUser: '10001' is not of "
        "type 'integer'",
    ),
    "sm-unknown-field.yaml": (
        "monitoring/servicemonitor.yaml",
        "      interval: 30s\n",
        "      intervall: 30s\n",
        "ServiceMonitor/cached: spec.endpoints.0.intervall: Extra inputs are not permitted",
    ),
    "sm-wrong-type.yaml": (
        "monitoring/servicemonitor.yaml",
        "    - port: http\n",
        "    - port: 9464\n",
        "ServiceMonitor/cached: spec.endpoints.0.port: Input should be a valid string",
    ),
    "sm-bad-value.yaml": (
        "monitoring/servicemonitor.yaml",
        "      scheme: http\n",
        "      scheme: tcp\n",
        "ServiceMonitor/cached: spec.endpoints.0.scheme: Input should be 'http' or 'https'",
    ),
    "duplicate-key.yaml": (
        "service.yaml",
        "  clusterIP: None\n",
        "  clusterIP: None\n  clusterIP: 10.0.0.1\n",
        "duplicate key 'clusterIP'",
    ),
    "selects-nothing.yaml": (
        "service.yaml",
        "  selector:\n    app.kubernetes.io/name: cached\n",
        "  selector:\n    app.kubernetes.io/name: cache\n",
        "Service/cached: spec.selector {'app.kubernetes.io/name': 'cache'} selects no pod",
    ),
    "unknown-kind.yaml": (
        "service.yaml",
        "apiVersion: v1\nkind: Service\n",
        "apiVersion: example.com/v1\nkind: Widget\n",
        "Widget/cached: no schema for Widget (example.com/v1)",
    ),
}


def run(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), *map(str, paths)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_shipped_manifests_pass() -> None:
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    for kind in ("PriorityClass", "Namespace", "DaemonSet", "Service", "ServiceMonitor", "Pod"):
        assert f"{kind}/" in r.stdout
    assert "FAIL" not in r.stdout
    assert r.stdout.splitlines()[-1].startswith("k8s manifests: 10 objects in 7 files, all valid")


def test_each_defect_fails_naming_file_and_error(tmp_path: Path) -> None:
    # The shipped set (so references resolve), plus one broken copy per defect.
    shutil.copytree(K8S, tmp_path / "shipped")
    for name, (source, old, new, _) in BROKEN.items():
        text = (K8S / source).read_text()
        assert old in text, f"{source} changed: update this test's {name}"
        (tmp_path / name).write_text(text.replace(old, new, 1))

    r = run(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    fails = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    for name, (*_, expected) in BROKEN.items():
        assert any(f"{tmp_path / name}: " in f and expected in f for f in fails), (name, r.stdout)
    assert not [f for f in fails if "/shipped/" in f], r.stdout
    assert len(fails) == len(BROKEN), r.stdout


def test_no_manifests_fails(tmp_path: Path) -> None:
    r = run(tmp_path)
    assert r.returncode == 1
    assert "no manifests" in r.stdout
