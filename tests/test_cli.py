"""The command line: clear errors for bad input and configuration, no secrets in messages."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.checker import REPO


def postbox(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=120,
        check=False,
    )


def test_bad_policy_file_is_refused_with_the_setting_named(tmp_path, database):
    cfg = tmp_path / "p.toml"
    cfg.write_text('[consumers.basic]\non_dead_letter = "explode"\n')
    r = postbox(
        "--config",
        str(cfg),
        "--database-url",
        database.url,
        "worker",
        "--consumer",
        "basic",
        "--app",
        "tests.apps.basic:registry",
    )
    assert r.returncode == 2
    assert "consumers.basic.on_dead_letter" in r.stderr
    assert "Traceback" not in r.stderr


def test_short_dedup_retention_is_refused(tmp_path, database):
    cfg = tmp_path / "p.toml"
    cfg.write_text("[postbox]\ndedup_retention_seconds = 60\n")
    r = postbox(
        "--config",
        str(cfg),
        "--database-url",
        database.url,
        "worker",
        "--consumer",
        "basic",
        "--app",
        "tests.apps.basic:registry",
    )
    assert r.returncode == 2 and "dedup_retention_seconds" in r.stderr


def test_unknown_app_and_consumer_are_clear_errors(database):
    r = postbox(
        "--database-url", database.url, "worker", "--consumer", "basic", "--app", "nope.nothing:registry"
    )
    assert r.returncode == 2 and "cannot import nope.nothing" in r.stderr
    r = postbox(
        "--database-url", database.url, "worker", "--consumer", "other", "--app", "tests.apps.basic:registry"
    )
    assert r.returncode == 2 and "no handler for consumer 'other'" in r.stderr


def test_password_never_appears_in_error_output(tmp_path):
    url = "postgresql://postbox:s3cr3t-pw@127.0.0.1:1/nowhere"
    r = postbox("--database-url", url, "migrate")
    assert r.returncode != 0
    assert "s3cr3t-pw" not in r.stderr + r.stdout
