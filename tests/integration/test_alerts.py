"""epp's alerting rules (deploy/monitoring/epp-alerts.yaml): real promtool checks them and runs
their unit tests (a firing case for every alert), the chart renders them as a PrometheusRule
only when asked, for its own job, and every alert has its runbook paragraph in the docs.

promtool comes from Debian's ``prometheus`` package (``.ci/run`` installs it); without it the
promtool tests skip on a developer's machine and fail in CI."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.integration.test_deploy import CHART, docs_of, run, tool, validate_custom_resources
from tests.prometheus_tools import prometheus_tool

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "epp-alerts.yaml"


def promtool() -> str:
    return prometheus_tool("promtool")


def alerts() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout


def test_promtool_unit_tests_pass_and_every_alert_has_a_firing_case() -> None:
    tests = yaml.safe_load((MONITORING / "epp-alerts.test.yaml").read_text())
    firing = {case["alertname"] for t in tests["tests"] for case in t.get("alert_rule_test", [])
              if case.get("exp_alerts")}  # fmt: skip
    assert firing == {str(a["alert"]) for a in alerts()}
    done = subprocess.run([promtool(), "test", "rules", "epp-alerts.test.yaml"], cwd=MONITORING,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_runbook_paragraph() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    headings = {h.strip().lower() for h in re.findall(r"^#### (\w+)\s*$", doc, re.M)}
    for alert in alerts():
        annotations = alert["annotations"]
        assert isinstance(annotations, dict)
        anchor = str(alert["alert"]).lower()
        assert annotations["runbook_url"] == f"docs/observability.md#{anchor}"
        assert anchor in headings, f"docs/observability.md has no '#### {alert['alert']}' runbook"


def test_the_chart_renders_the_same_rules_for_its_own_job_only_when_asked() -> None:
    assert (CHART / "files" / "epp-alerts.yaml").read_text() == RULES.read_text()
    helm = tool("helm")
    assert not [d for d in docs_of(run(helm, "template", "llama", str(CHART))) if d["kind"] == "PrometheusRule"]
    docs = docs_of(run(helm, "template", "llama", str(CHART), "--set", "prometheusRule.enabled=true",
                       "--set", "prometheusRule.labels.release=kps"))  # fmt: skip
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    service = next(d for d in docs if d["kind"] == "Service" and any(
        p["name"] == "http-metrics" for p in d["spec"]["ports"]))  # fmt: skip
    assert rule["metadata"]["labels"]["release"] == "kps"
    expected = RULES.read_text().replace('job="epp"', f'job="{service["metadata"]["name"]}"')
    assert rule["spec"]["groups"] == yaml.safe_load(expected)["groups"]
    validate_custom_resources([rule])
