"""The configuration file reaches the processes: ``[postbox]`` settings (log format and level, the
start-up wait for the database) and the command tables (``[postbox.worker]``, ...) as the defaults of
each command's options, below its flags and environment variables."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import click
import pytest

from postbox.cli.root import cli
from postbox.config.settings import (
    BridgeOptions,
    MaintainOptions,
    RelayOptions,
    ReplayRunOptions,
    WorkerOptions,
)
from tests.helpers import eventually, scalar, spawn_postbox
from tests.proxy import database_proxy

WORKER = ("worker", "--consumer", "mis", "--app", "tests.apps.misbehaving:registry")


def start(config: Path, url: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return spawn_postbox("--config", str(config), "--database-url", url, *args, stderr=out.fileno())


def ended(p: subprocess.Popen[bytes], timeout: float) -> int:
    """The exit status of ``p`` within ``timeout`` seconds (killed if it is still running then)."""
    try:
        return p.wait(timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def stop(p: subprocess.Popen[bytes]) -> int:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    return ended(p, 20)


def test_the_files_log_format_and_connect_timeout_apply_to_a_process_without_those_flags(database, tmp_path):
    """``log_format = "text"`` and ``connect_timeout = 1`` in ``[postbox]``: a worker whose database
    refuses connections gives up after about a second (exit 1), its log lines in text, none JSON."""
    config = tmp_path / "postbox.toml"
    config.write_text('[postbox]\nlog_format = "text"\nconnect_timeout = 1\n')
    proxy, url = database_proxy(database.url)
    proxy.down()
    log = tmp_path / "worker.log"
    p = start(config, url, *WORKER, log=log)
    assert ended(p, 30) == 1
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert any(
        "gave up after" in line and "connect_timeout = 1 in the configuration file" in line for line in lines
    ), lines
    assert not any(line.lstrip().startswith("{") for line in lines), lines


def test_a_flag_outranks_the_file(database, tmp_path):
    """``--log-format json`` and ``--connect-timeout`` on the command line win over the file's."""
    config = tmp_path / "postbox.toml"
    config.write_text('[postbox]\nlog_format = "text"\nconnect_timeout = 600\n')
    proxy, url = database_proxy(database.url)
    proxy.down()
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        p = spawn_postbox(
            "--config", str(config), "--database-url", url, "--log-format", "json",
            *WORKER, "--connect-timeout", "0.5", stderr=out.fileno(),
        )  # fmt: skip
    assert ended(p, 30) == 1
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert any("gave up after" in entry["msg"] for entry in lines), lines


@pytest.mark.parametrize(("flags", "expected"), [((), 3), (("--concurrency", "1"), 1)])
def test_a_command_table_sets_the_defaults_of_its_options(database, tmp_path, flags, expected):
    """``[postbox.worker] concurrency = 3``: a worker started without ``--concurrency`` runs 3 slots
    (its registration says so); with the flag, the flag's."""
    config = tmp_path / "postbox.toml"
    config.write_text("[postbox.worker]\nconcurrency = 3\nheartbeat_interval = 0.2\n")
    log = tmp_path / "worker.log"
    p = start(config, database.url, *WORKER, *flags, log=log)
    try:
        eventually(
            lambda: scalar(database.url, "SELECT concurrency FROM postbox.workers WHERE kind = 'worker'"),
            what="the worker registered",
        )
        assert (
            scalar(database.url, "SELECT concurrency FROM postbox.workers WHERE kind = 'worker'") == expected
        )
    finally:
        assert stop(p) == 0, log.read_text()


@pytest.mark.parametrize(
    ("path", "options"),
    [
        (("worker",), WorkerOptions),
        (("relay",), RelayOptions),
        (("bridge",), BridgeOptions),
        (("maintain",), MaintainOptions),
        (("replay", "run"), ReplayRunOptions),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else "",
)
def test_every_setting_of_a_command_table_is_an_option_of_that_command(path, options):
    """A name in ``[postbox.worker]`` (...) that the command has no option for would be ignored."""
    command: click.Command = cli
    for name in path:
        assert isinstance(command, click.Group)
        found = command.get_command(click.Context(command), name)
        assert found is not None
        command = found
    params = {p.name for p in command.params}
    assert set(options.model_fields) <= params
