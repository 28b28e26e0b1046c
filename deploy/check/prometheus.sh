#!/usr/bin/env bash
# promtool on the alert rules (deploy/prometheus/): `check rules` (YAML, PromQL, the
# annotation templates, duplicate rules) on the rule file, and `test rules` on its unit
# tests, which Prometheus' own engine evaluates: each alert on series that must make it
# fire and series that must not. The PrometheusRule under deploy/k8s/monitoring/ is
# generated from the same file, so this covers it too.
# Without promtool it says so in one line and exits 0 (a skip, not a pass).
set -euo pipefail
cd "$(dirname "$0")/../.."

promtool=${PROMTOOL:-promtool}
if ! command -v "$promtool" >/dev/null; then
    echo "prometheus: $promtool not found, skipped (make system-deps installs it: Debian's prometheus)"
    exit 0
fi

run() {
    local out
    if ! out=$("$promtool" "$@" 2>&1); then
        echo "prometheus: FAILED: $promtool $*" >&2
        echo "$out" >&2
        exit 1
    fi
}
run check rules deploy/prometheus/cached-rules.yml
run test rules deploy/prometheus/cached-rules.test.yml
version=$("$promtool" --version 2>&1 | awk 'NR == 1 {print $3}')
echo "prometheus: ok (promtool $version: check rules deploy/prometheus/cached-rules.yml; test rules deploy/prometheus/cached-rules.test.yml)"
