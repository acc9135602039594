"""The shipped alert rules, evaluated by Prometheus's own promtool: ``promtool check rules`` over
deploy/prometheus/alerts.yml, and ``promtool test rules`` over deploy/prometheus/alerts_test.yml,
which has a case for every alert (checked here from both files)."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.helpers import REPO

RULES = REPO / "deploy/prometheus/alerts.yml"
RULE_TESTS = REPO / "deploy/prometheus/alerts_test.yml"


def promtool() -> str:
    """The promtool command; missing is a failure (CI installs it), never a skip."""
    found = shutil.which("promtool")
    assert found, (
        "promtool is not installed: install Debian's prometheus package "
        "(apt-get install prometheus), which provides /usr/bin/promtool"
    )
    return found


def _run(*args: str) -> str:
    done = subprocess.run(
        [promtool(), *args], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def _alerts() -> list[str]:
    rules = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_rules():
    """``promtool check rules deploy/prometheus/alerts.yml`` succeeds and finds every rule."""
    output = _run("check", "rules", str(RULES.relative_to(REPO)))
    assert f"SUCCESS: {len(_alerts())} rules found" in output, output


def test_promtool_rule_tests_pass():
    """``promtool test rules deploy/prometheus/alerts_test.yml`` succeeds."""
    output = _run("test", "rules", str(RULE_TESTS.relative_to(REPO)))
    assert "SUCCESS" in output, output


def test_every_alert_has_a_firing_and_a_quiet_case():
    """Each alert of alerts.yml is expected to fire in some case of alerts_test.yml (an ``exp_alerts``
    that is not empty) and to stay quiet in another (empty ``exp_alerts``); the test file loads
    alerts.yml itself; every series carries job and instance labels, as a scrape adds them."""
    tests = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))
    assert tests["rule_files"] == ["alerts.yml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for series in case.get("input_series", []):
            assert 'job="' in series["series"] and 'instance="' in series["series"], series
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = set(_alerts())
    assert alerts, "no alert in alerts.yml"
    assert not alerts - firing, f"alerts never expected to fire: {sorted(alerts - firing)}"
    assert not alerts - quiet, f"alerts never expected to stay quiet: {sorted(alerts - quiet)}"
    assert not (firing | quiet) - alerts, f"cases of unknown alerts: {sorted((firing | quiet) - alerts)}"
