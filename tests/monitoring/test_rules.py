"""The alert rules (ansible/roles/monitoring/files/hio.rules.yml): Prometheus reads them,
`promtool test rules` sees each fire on the series that should set it off and stay silent
on those that should not, and they use only metrics the roles export."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.monitoring.promql import (
    DOC,
    RULES,
    RULES_TEST,
    alert_rules,
    documented_metrics,
    names_used,
    problems,
    run_promtool,
)


def test_promtool_reads_the_rules() -> None:
    output = run_promtool("check", "rules", str(RULES))
    assert f"SUCCESS: {len(alert_rules())} rules found" in output


def test_promtool_sees_every_alert_fire_and_stay_silent_as_its_tests_say() -> None:
    output = run_promtool("test", "rules", str(RULES_TEST))
    assert "SUCCESS" in output


def _rule_tests() -> list[dict[str, Any]]:
    return [check for test in yaml.safe_load(RULES_TEST.read_text())["tests"] for check in test["alert_rule_test"]]


def test_every_alert_is_tested_firing_and_silent() -> None:
    alerts = {str(rule["alert"]) for rule in alert_rules()}
    firing = {check["alertname"] for check in _rule_tests() if check["exp_alerts"]}
    silent = {check["alertname"] for check in _rule_tests() if not check["exp_alerts"]}
    assert alerts == firing, f"never seen firing: {alerts - firing}; unknown: {firing - alerts}"
    assert alerts == silent, f"never seen silent: {alerts - silent}; unknown: {silent - alerts}"


def test_the_rules_and_their_tests_use_only_metrics_the_roles_export() -> None:
    metrics = documented_metrics()
    found = [f"{rule['alert']}: {p}" for rule in alert_rules() for p in problems(str(rule["expr"]), metrics)]
    series = [s["series"] for test in yaml.safe_load(RULES_TEST.read_text())["tests"] for s in test["input_series"]]
    found += [f"test input {s}: {p}" for s in series for p in problems(s, metrics)]
    assert not found, "\n".join(found)
    assert all(names_used(str(rule["expr"])) for rule in alert_rules())


def test_every_alert_says_what_is_wrong_and_what_to_do_and_is_documented() -> None:
    doc = DOC.read_text()
    for rule in alert_rules():
        labels, annotations = rule["labels"], rule["annotations"]
        assert isinstance(labels, dict) and labels["severity"] in ("critical", "warning"), rule["alert"]
        assert isinstance(annotations, dict) and set(annotations) == {"summary", "description"}, rule["alert"]
        assert len(annotations["description"]) > 2 * len(annotations["summary"]), rule["alert"]
        # each alert has its entry in docs/monitoring.md: when it fires, what to do
        assert re.search(rf"^\| `{rule['alert']}` \|", doc, re.MULTILINE), f"{rule['alert']} is not in the docs"
