#!/usr/bin/env python3
"""Write the PrometheusRule for the Prometheus Operator from the rule file.

Usage: ``deploy/prometheus/prometheusrule.py [--check]``. Reads
``deploy/prometheus/cached-rules.yml`` and writes
``deploy/k8s/monitoring/prometheusrule.yaml``: a PrometheusRule whose ``spec.groups`` is
that file's ``groups``, copied as text (indented under ``spec:``), so the comments that
explain each rule come along. With ``--check`` it writes nothing and exits 1 when the
shipped PrometheusRule differs from what it would write (``tests/test_alerts.py`` runs it).

Why generate rather than keep two copies: the rules are tested once, by promtool, on the
rule file (``deploy/check/prometheus.sh``); a copy kept by hand could drift from what was
tested without anything noticing. Generated, the two are the same by construction, and
``--check`` catches an edit of the copy or a rule file changed without regenerating.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "cached-rules.yml"
OUTPUT = ROOT / "deploy" / "k8s" / "monitoring" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/cached-rules.yml by deploy/prometheus/prometheusrule.py:
# edit that file and run the script; do not edit this one (tests/test_alerts.py checks that
# it is what the script writes).
#
# The daemons' recording and alerting rules for the Prometheus Operator; what each alert
# means and what to do: docs/observability.md, "Alerts and Grafana". Needs the Operator's
# CRDs (monitoring.coreos.com/v1), like the ServiceMonitor beside it:
#   kubectl apply -f deploy/k8s/monitoring/
# Your Prometheus resource must select it: its ruleSelector often requires a label (e.g.
# `release: <helm release name>` with kube-prometheus-stack; add it with
# `kubectl -n cached label prometheusrule cached release=<name>`) and its
# ruleNamespaceSelector must include namespace `cached`. The alerts expect the daemons'
# scrape job to be `cached`, which is what the ServiceMonitor `cached` gives them.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: cached
  namespace: cached
  labels:
    app.kubernetes.io/name: cached
spec:
"""


def render(rules_text: str) -> str:
    """The PrometheusRule for the rule file's text: its ``groups:`` and everything after,
    indented two spaces under ``spec:`` (blank lines stay blank). The rule file's header
    comment, above ``groups:``, is left out: it is about the file, and HEADER replaces it."""
    lines = rules_text.splitlines()
    try:
        start = lines.index("groups:")
    except ValueError:
        raise SystemExit(f"{RULES}: no top-level 'groups:' line") from None
    body = "".join(f"  {line}\n" if line.strip() else "\n" for line in lines[start:])
    return HEADER + body


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the shipped file differs"
    )
    args = parser.parse_args(argv)
    wanted = render(RULES.read_text())
    shown = OUTPUT.relative_to(ROOT)
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else None
        if current != wanted:
            script = Path(__file__).resolve().relative_to(ROOT)
            print(f"{shown}: not what {script} writes from {RULES.relative_to(ROOT)}; run it")
            return 1
        print(f"{shown}: up to date")
        return 0
    OUTPUT.write_text(wanted)
    print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
