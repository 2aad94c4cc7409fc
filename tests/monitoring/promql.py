"""What the monitoring files may use, and what they do use.

The metrics the roles export are the ones docs/monitoring.md lists
(tests/e2e/test_metrics.py checks every family a role shows is listed there, and
:func:`documented_metrics` is checked against a running cluster by
tests/monitoring/test_scrape.py). An expression's metric names, label names and label
values are read with regular expressions: our expressions name metrics ``hio_*``,
``process_*`` and ``up`` only.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE_FILES = REPO / "ansible" / "roles" / "monitoring" / "files"
RULES = ROLE_FILES / "hio.rules.yml"
DASHBOARD = ROLE_FILES / "hio-dashboard.json"
RULES_TEST = Path(__file__).resolve().parent / "hio.rules.test.yml"
DOC = REPO / "docs" / "monitoring.md"

#: Labels Prometheus adds to every series of a target (the role's scrape configuration).
TARGET_LABELS = frozenset({"job", "instance"})
#: Labels whose values come from a set the docs name (each value in backticks).
ENUM_LABELS = frozenset({"state", "route", "result", "peer", "code"})

_ROW = re.compile(r"^\| `(hio_[a-z0-9_]+)` \| (counter|gauge|histogram) \|([^|]*)\|", re.MULTILINE)
_NAME = re.compile(r"\b(?:hio|process)_[a-z0-9_]+\b|\bup(?=\{)")
_SELECTOR = re.compile(r"\b((?:hio|process)_[a-z0-9_]+|up)\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter, gauge, histogram
    labels: frozenset[str]

    def series_names(self) -> set[str]:
        """The names its samples carry in the text format."""
        if self.kind == "histogram":
            return {f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count"}
        return {self.name}


def documented_metrics() -> dict[str, Metric]:
    """Every metric docs/monitoring.md lists, by each name its samples carry; plus the
    process's own figures every role exports and Prometheus' ``up``."""
    doc = DOC.read_text()
    metrics = {}
    for name, kind, labels in _ROW.findall(doc):
        metric = Metric(name, kind, frozenset(re.findall(r"`(\w+)`", labels)))
        metrics |= dict.fromkeys(metric.series_names(), metric)
    for name in re.findall(r"`(process_[a-z_]+)`", doc):
        metrics[name] = Metric(name, "counter" if name.endswith("_total") else "gauge", frozenset())
    metrics["up"] = Metric("up", "gauge", frozenset())
    return metrics


def names_used(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def problems(expr: str, metrics: dict[str, Metric]) -> list[str]:
    """What in ``expr`` the roles do not export: a metric name, a label of a metric, a label
    value outside its documented set."""
    doc = DOC.read_text()
    found = [f"{name} is not a metric the roles export" for name in sorted(names_used(expr) - set(metrics))]
    known_labels = TARGET_LABELS | {"le"} | {label for m in metrics.values() for label in m.labels}
    for name, matchers in _SELECTOR.findall(expr):
        metric = metrics.get(name)
        for label, op, value in _MATCHER.findall(matchers):
            allowed = TARGET_LABELS | (metric.labels if metric else frozenset())
            if label not in allowed:
                found.append(f"{name} has no label {label}")
            if label in ENUM_LABELS and op in ("=", "!=") and f"`{value}`" not in doc:
                found.append(f"{label}={value!r} is not a documented value")
    for group in _GROUPING.findall(expr):
        for label in filter(None, (part.strip() for part in group.split(","))):
            if label not in known_labels:
                found.append(f"no metric has the label {label} that {expr!r} groups by")
    return found


def alert_rules() -> list[dict[str, object]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def promtool() -> str:
    """The promtool command; skip the test when it is not installed."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed: apt-get install prometheus (Debian's package provides it)")
    return path


def run_promtool(*args: str) -> str:
    """Run promtool; fail the test with its output when it fails."""
    proc = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed ({proc.returncode}):\n{output}"
    return output


def check_expressions(exprs: Iterable[str], folder: Path) -> str:
    """Have Prometheus' own parser read ``exprs``: as recording rules, `promtool check rules`."""
    rules = {"groups": [{"name": "check", "rules": [{"record": f"check:{n}", "expr": e} for n, e in enumerate(exprs)]}]}
    path = folder / "expressions.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return run_promtool("check", "rules", str(path))
