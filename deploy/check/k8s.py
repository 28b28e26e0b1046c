#!/usr/bin/env python3
"""Validate the Kubernetes manifests strictly and offline (``make deploy-lint``).

Usage: ``deploy/check/k8s.py [PATH ...]``: files, or directories searched recursively for
``*.yaml``/``*.yml``; by default the repository's ``deploy/k8s/``. References between
objects are resolved within the files checked together, so check a whole set.

Every object is checked against its kind's schema, unknown fields rejected at any depth:

- Kubernetes' own kinds: the strict JSON schemas shipped in kubernetes-validate, of the
  newest Kubernetes version it ships (1.37 with kubernetes-validate 1.37.0).
- ServiceMonitor and PrometheusRule (Prometheus Operator CRDs, which kubernetes-validate
  has no schema for): the pydantic models that cloudcoil-models-prometheus-operator
  generates from the Operator's CRD schemas (its version 0.80.1.0: Operator v0.80.1),
  validated with ``extra="forbid"`` (unknown fields) and ``strict=True`` (no coercion of
  types, as the API server does not coerce them either). A PrometheusRule's PromQL is not
  parsed here: it is generated from deploy/prometheus/cached-rules.yml, which promtool
  checks and tests (deploy/check/prometheus.sh).

A kind with neither fails: an object this script cannot check is not passed. The YAML is
read with duplicate keys rejected (PyYAML keeps the last silently; kubectl rejects them).
Then references between the objects checked together: a workload's selector must match
its pod template, a Service's selector some pod and its named targetPort their ports, a
ServiceMonitor's selector some Service and its port that Service's ports, and a
priorityClassName must name a PriorityClass of the set or a system one.

Prints one line per object and a summary line; exit 0 when all pass, else 1. Schemas only:
nothing here reaches a cluster (``kubectl apply --dry-run=server`` does that).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]
from kubernetes_validate import utils as kv  # type: ignore[import-untyped]

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION: str = kv.latest_version()

# CRD kinds kubernetes-validate has no schema for: (apiVersion, kind) -> the pydantic model
# (module, class) generated from the CRD, and the package that ships it.
CRD_PACKAGE = "cloudcoil-models-prometheus-operator"
CRD_MODELS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): (
        "cloudcoil.models.prometheus_operator.v1",
        "ServiceMonitor",
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): (
        "cloudcoil.models.prometheus_operator.v1",
        "PrometheusRule",
    ),
}

WORKLOADS = {"DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"}
SYSTEM_PRIORITY_CLASSES = {"system-node-critical", "system-cluster-critical"}


@dataclass
class Obj:
    """One Kubernetes object of a manifest file."""

    path: str
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.doc["metadata"].get("namespace") or "default")

    def __str__(self) -> str:
        return f"{self.path}: {self.kind}/{self.name}"


@dataclass
class PodSet:
    """The pods an object creates: where, with which labels and named container ports."""

    owner: Obj
    labels: dict[str, str]
    ports: set[str]
    priority_class: str | None


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that rejects a mapping with a duplicate key."""


def _no_duplicates(loader: Any, node: Any, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def manifest_files(paths: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in (".yaml", ".yml"))
        else:
            files.append(p)
    return files


def _shown(p: Path) -> str:
    """The path relative to the working directory where it is inside it."""
    try:
        return str(p.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def _yaml_error(e: Exception) -> str:
    """A YAML error on one line: where, and what."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(e).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _loc(parts: Sequence[Any]) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


def _shape_errors(doc: Any) -> list[str]:
    """What a document lacks to be an object that can be checked at all."""
    if not isinstance(doc, dict):
        return [f"not a mapping but {type(doc).__name__}"]
    errors = [
        f"{k}: missing or not a string"
        for k in ("apiVersion", "kind")
        if not isinstance(doc.get(k), str)
    ]
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        errors.append("metadata.name: missing or not a string")
    return errors


def validate_k8s(doc: dict[str, Any]) -> list[str]:
    """kubernetes-validate, strict schemas; a kind it has no schema for is an error."""
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as e:
        return [f"{_loc(list(e.path))}: {e.message}"]
    except kv.SchemaNotFoundError:
        return [
            f"no schema for {doc['kind']} ({doc['apiVersion']}): neither kubernetes-validate "
            f"{kv.major_minor(K8S_VERSION)} has one nor CRD_MODELS in this script"
        ]
    except (kv.InvalidSchemaError, kv.VersionNotSupportedError) as e:
        return [str(e.message)]
    return []


def validate_crd(doc: dict[str, Any], module: str, cls: str) -> list[str]:
    """The CRD's pydantic model with unknown fields forbidden and no type coercion."""
    try:
        model = getattr(importlib.import_module(module), cls)
        from pydantic import ValidationError
    except ImportError as e:
        return [f"cannot check this kind: {e} (install {CRD_PACKAGE}, see pyproject.toml)"]
    try:
        model.model_validate(doc, strict=True, extra="forbid")
    except ValidationError as e:
        return [f"{_loc(err['loc'])}: {err['msg']}" for err in e.errors()]
    return []


def validate(doc: dict[str, Any]) -> list[str]:
    crd = CRD_MODELS.get((doc["apiVersion"], doc["kind"]))
    return validate_crd(doc, *crd) if crd else validate_k8s(doc)


def _matches(selector: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _get(doc: Any, *keys: str) -> Any:
    for k in keys:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def pod_sets(objs: Sequence[Obj]) -> list[PodSet]:
    out = []
    for o in objs:
        if o.kind == "Pod":
            meta, spec = o.doc["metadata"], o.doc.get("spec")
        elif o.kind in WORKLOADS:
            meta, spec = (
                _get(o.doc, "spec", "template", "metadata"),
                _get(o.doc, "spec", "template", "spec"),
            )
        else:
            continue
        ports = {
            str(port["name"])
            for c in _get(spec, "containers") or []
            for port in c.get("ports") or []
            if "name" in port
        }
        out.append(
            PodSet(o, dict(_get(meta, "labels") or {}), ports, _get(spec, "priorityClassName"))
        )
    return out


def _pod_problems(pods: Sequence[PodSet], objs: Sequence[Obj]) -> list[tuple[Obj, str]]:
    problems = []
    classes = SYSTEM_PRIORITY_CLASSES | {o.name for o in objs if o.kind == "PriorityClass"}
    for ps in pods:
        selector = _get(ps.owner.doc, "spec", "selector", "matchLabels") or {}
        if ps.owner.kind in WORKLOADS and not _matches(selector, ps.labels):
            problems.append((ps.owner, f"spec.selector {selector} does not match the pod labels"))
        if ps.priority_class and ps.priority_class not in classes:
            problems.append((ps.owner, f"priorityClassName {ps.priority_class!r}: not defined"))
    return problems


def _service_problems(pods: Sequence[PodSet], services: Sequence[Obj]) -> list[tuple[Obj, str]]:
    problems = []
    for svc in services:
        selector = _get(svc.doc, "spec", "selector")
        if not selector:
            continue
        targets = [
            ps
            for ps in pods
            if ps.owner.namespace == svc.namespace and _matches(selector, ps.labels)
        ]
        if not targets:
            problems.append(
                (svc, f"spec.selector {selector} selects no pod in namespace {svc.namespace}")
            )
        for port in _get(svc.doc, "spec", "ports") or []:
            target = port.get("targetPort")
            if isinstance(target, str) and any(target not in ps.ports for ps in targets):
                problems.append((svc, f"targetPort {target!r}: not a named port of its pods"))
    return problems


def _monitor_problems(services: Sequence[Obj], objs: Sequence[Obj]) -> list[tuple[Obj, str]]:
    problems = []
    for sm in (o for o in objs if o.kind == "ServiceMonitor"):
        selector = _get(sm.doc, "spec", "selector", "matchLabels")
        if not selector:  # matchExpressions alone are not resolved here
            continue
        scope = _get(sm.doc, "spec", "namespaceSelector") or {}
        namespaces = scope.get("matchNames") or [sm.namespace]
        targets = [
            svc
            for svc in services
            if (scope.get("any") or svc.namespace in namespaces)
            and _matches(selector, _get(svc.doc, "metadata", "labels") or {})
        ]
        if not targets:
            problems.append((sm, f"spec.selector {selector} selects no Service"))
        names = {p.get("name") for svc in targets for p in _get(svc.doc, "spec", "ports") or []}
        for ep in _get(sm.doc, "spec", "endpoints") or []:
            port = ep.get("port")
            if targets and port is not None and port not in names:
                problems.append((sm, f"endpoint port {port!r}: not a port of its Service"))
    return problems


def check_references(objs: Sequence[Obj]) -> list[tuple[Obj, str]]:
    """References between the objects checked together that resolve to nothing."""
    pods = pod_sets(objs)
    services = [o for o in objs if o.kind == "Service"]
    return (
        _pod_problems(pods, objs)
        + _service_problems(pods, services)
        + _monitor_problems(services, objs)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "paths", nargs="*", type=Path, default=[DEFAULT_DIR], help="files or directories"
    )
    args = parser.parse_args(argv)

    files = manifest_files(args.paths)
    if not files:
        print(f"FAIL no manifests (*.yaml, *.yml) under {' '.join(map(str, args.paths))}")
        return 1
    failed = checked = 0
    objs: list[Obj] = []
    for f in files:
        shown = _shown(f)
        try:
            docs = [d for d in yaml.load_all(f.read_text(), Loader=_StrictLoader) if d is not None]
        except (OSError, yaml.YAMLError) as e:
            print(f"FAIL {shown}: {_yaml_error(e)}")
            failed += 1
            continue
        if not docs:
            print(f"FAIL {shown}: no object in the file")
            failed += 1
        for i, doc in enumerate(docs):
            errors = _shape_errors(doc)
            if errors:
                print(f"FAIL {shown}: document {i + 1}: {'; '.join(errors)}")
                failed += 1
                continue
            obj = Obj(shown, doc)
            checked += 1
            errors = validate(doc)
            if errors:
                print(f"FAIL {obj}: " + "\n     ".join(errors))
                failed += 1
            else:
                print(f"OK   {obj}")
                objs.append(obj)  # references only between valid objects: no cascades
    for obj, problem in check_references(objs):
        print(f"FAIL {obj}: {problem}")
        failed += 1

    versions = f"Kubernetes {kv.major_minor(K8S_VERSION)} strict schemas (kubernetes-validate "
    versions += f"{metadata.version('kubernetes-validate')})"
    with contextlib.suppress(metadata.PackageNotFoundError):
        versions += (
            f", ServiceMonitor, PrometheusRule: {CRD_PACKAGE} {metadata.version(CRD_PACKAGE)}"
        )
    verdict = "all valid" if not failed else f"{failed} problem{'s' * (failed > 1)}"
    print(f"k8s manifests: {checked} objects in {len(files)} files, {verdict}; {versions}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
