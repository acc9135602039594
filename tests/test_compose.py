"""docker-compose.yml and the Dockerfile, checked without Docker (it cannot run on our machines).

The compose file is parsed and every service is checked for what Docker would need: an image or a
build context with its Dockerfile, health checks where others wait for health, dependencies on
services that exist with valid conditions, mounted files that exist, ``POSTBOX_…`` variables that
are real settings, and ``postbox …`` commands that click accepts (unknown commands or options,
missing required options and bad values fail). Then the worker command lines of the compose file
are run, with the same config file, against the test database and seen processing messages.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import signal
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import click
import psycopg
import pytest
import yaml

from postbox.cli.root import cli
from postbox.config.policies import build_transports, load_policies
from postbox.config.settings import Settings, load_settings
from postbox.inbox.handlers import Registry
from postbox.inbox.receive import receive
from tests.conftest import Database, _conninfo_url
from tests.helpers import REPO, eventually, scalar, spawn_postbox
from tests.test_alert_rules import promtool
from tests.test_observability import free_port

COMPOSE_FILE = REPO / "docker-compose.yml"
DEPENDENCY_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
PULL_POLICIES = {"always", "never", "missing", "if_not_present", "build", "daily", "weekly"}


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), "no services: section"
    return data


COMPOSE = _compose()
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def _build(service: dict[str, Any]) -> tuple[Path, Path] | None:
    """The build context and Dockerfile of a service, or None if it uses a ready-made image."""
    build = service.get("build")
    if build is None:
        return None
    if isinstance(build, str):
        build = {"context": build}
    context = (COMPOSE_FILE.parent / build.get("context", ".")).resolve()
    return context, context / build.get("dockerfile", "Dockerfile")


def _is_postbox(service: dict[str, Any]) -> bool:
    """Runs the image built from our Dockerfile (whose entrypoint is ``postbox``)."""
    built = _build(service)
    return built is not None and built[1] == REPO / "Dockerfile"


POSTBOX_SERVICES = sorted(name for name, s in SERVICES.items() if _is_postbox(s))
# The long-running ones (not the one-shot migration): each serves metrics and has a healthcheck.
RUNNING_SERVICES = [name for name in POSTBOX_SERVICES if SERVICES[name].get("restart", "no") != "no"]


def _depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):  # short form: service_started
        return {name: {"condition": "service_started"} for name in deps}
    assert isinstance(deps, dict)
    return deps


def _bind_mounts(service: dict[str, Any]) -> list[tuple[Path, PurePosixPath]]:
    """(host path, container path) of every bind mount; named volumes are skipped."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") != "bind":
                continue
            source, target = volume["source"], volume["target"]
        else:
            source, target = str(volume).split(":")[:2]
        if source.startswith(("./", "../", "/")):
            mounts.append(((COMPOSE_FILE.parent / source).resolve(), PurePosixPath(target)))
    return mounts


def _host_path(service: dict[str, Any], container_path: str) -> Path | None:
    """Where a path inside the container comes from on the host, through the bind mounts."""
    wanted = PurePosixPath(container_path)
    for host, target in _bind_mounts(service):
        if wanted == target:
            return host
        if target in wanted.parents:
            return host / wanted.relative_to(target)
    return None


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def _parse_postbox(args: list[str]) -> click.Context:
    """Parse ``postbox ARGS`` with click as the real command would, without running it: the group's
    options, then the subcommand's (unknown or missing options and bad values raise UsageError)."""
    group_ctx = cli.make_context("postbox", list(args))
    # The group stops at its first non-option: what is left is the subcommand and its arguments.
    sub = args[len(args) - len(group_ctx.args) - 1 :]
    assert sub, f"no subcommand in postbox {shlex.join(args)}"
    name, command, rest = cli.resolve_command(group_ctx, sub)
    assert command is not None and name is not None
    return command.make_context(name, rest, parent=group_ctx)


def _subcommand(name: str) -> str:
    """The ``postbox`` subcommand a service runs (``replay`` for ``replay run``), after the group's
    options."""
    ctx = _parse_postbox(_command(SERVICES[name]))
    while ctx.parent is not None and ctx.parent.parent is not None:
        ctx = ctx.parent
    return str(ctx.info_name)


# --- the compose file -------------------------------------------------------------------------


def test_the_compose_file_has_every_part_of_the_deployment():
    """PostgreSQL 15, RabbitMQ, a one-shot migration, worker, relay and bridge are all there."""
    images = {s.get("image", "") for s in SERVICES.values() if not _is_postbox(s)}
    assert any(re.fullmatch(r"postgres:15(\D.*)?", i) for i in images), images
    assert any(i.startswith("rabbitmq:") for i in images), images
    subcommands = {_subcommand(name) for name in POSTBOX_SERVICES}
    assert {"migrate", "worker", "relay", "bridge"} <= subcommands


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_has_an_image_or_a_build_whose_files_exist(name):
    """An image to pull, or a build context that exists with its Dockerfile (and a known pull policy)."""
    service = SERVICES[name]
    assert service.get("image") or service.get("build"), f"{name}: neither image nor build"
    built = _build(service)
    if built is not None:
        context, dockerfile = built
        assert context.is_dir(), f"{name}: build context {context} does not exist"
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
    if "pull_policy" in service:
        assert service["pull_policy"] in PULL_POLICIES


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_dependencies_exist_with_valid_conditions(name):
    """depends_on names services of the file, with a valid condition; waiting for health needs a
    health check; waiting for completion needs a one-shot service (no restart policy)."""
    for target, spec in _depends_on(SERVICES[name]).items():
        assert target in SERVICES, f"{name} depends on {target}, which is not a service"
        assert target != name
        condition = spec.get("condition", "service_started")
        assert condition in DEPENDENCY_CONDITIONS, f"{name} -> {target}: condition {condition!r}"
        if condition == "service_healthy":
            test = SERVICES[target].get("healthcheck", {}).get("test")
            assert test, f"{name} waits for {target} to be healthy, but {target} has no healthcheck"
            if isinstance(test, list):
                assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, test
        if condition == "service_completed_successfully":
            assert SERVICES[target].get("restart", "no") == "no", (
                f"{target} is a one-shot: restart must be no"
            )


def test_the_dependency_graph_has_no_cycle_and_everything_waits_for_the_migration():
    """Services start in an order (no cycle), and every long-running postbox process waits for
    the one-shot migration to complete, which waits for PostgreSQL to be healthy."""
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for target in _depends_on(SERVICES[name]):
                visit(target, (*path, name))
            done.add(name)

    for name in SERVICES:
        visit(name, ())
    migrations = [n for n in POSTBOX_SERVICES if _command(SERVICES[n])[0] == "migrate"]
    assert len(migrations) == 1
    (migration,) = migrations
    database_host = urlsplit(_environment(SERVICES[migration])["POSTBOX_DATABASE_URL"]).hostname
    assert _depends_on(SERVICES[migration]) == {database_host: {"condition": "service_healthy"}}
    for name in POSTBOX_SERVICES:
        if name != migration:
            condition = _depends_on(SERVICES[name]).get(migration, {}).get("condition")
            assert condition == "service_completed_successfully", name


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_mounted_files_exist_and_named_volumes_are_declared(name):
    """Every bind-mounted host path exists; every named volume is declared at the top level."""
    service = SERVICES[name]
    for host, _ in _bind_mounts(service):
        assert host.exists(), f"{name} mounts {host}, which does not exist"
    declared = set(COMPOSE.get("volumes") or {})
    for volume in service.get("volumes", []):
        source = volume.get("source") if isinstance(volume, dict) else str(volume).split(":")[0]
        if source and not source.startswith(("./", "../", "/")):
            assert source in declared, f"{name} uses volume {source!r}, not declared under volumes:"


@pytest.mark.parametrize("name", POSTBOX_SERVICES)
def test_postbox_settings_come_from_real_variables_and_files(name):
    """Every POSTBOX_ variable is a setting, the database host is a service of the file, and the
    config file named by POSTBOX_CONFIG is mounted into the container and valid."""
    env = _environment(SERVICES[name])
    fields = {f"POSTBOX_{field.upper()}" for field in Settings.model_fields}
    command = _parse_postbox(_command(SERVICES[name])).command  # and the variables of its options
    fields |= {str(p.envvar) for p in command.params if isinstance(p, click.Option) and p.envvar}
    for variable in env:
        if variable.startswith("POSTBOX_"):
            assert variable in fields, f"{name}: {variable} is not a Postbox setting"
    assert urlsplit(env["POSTBOX_DATABASE_URL"]).hostname in SERVICES
    config = _host_path(SERVICES[name], env["POSTBOX_CONFIG"])
    assert config is not None and config.is_file(), f"{name}: {env['POSTBOX_CONFIG']} is not mounted"
    load_settings(config, database_url=env["POSTBOX_DATABASE_URL"])
    load_policies(config)


@pytest.mark.parametrize("name", POSTBOX_SERVICES)
def test_every_postbox_command_is_a_real_command(name):
    """The service's command parses as a ``postbox`` command with its options and values; what it
    names (handler app and its consumer, relay destinations, broker host) exists."""
    service = SERVICES[name]
    args = _command(service)
    ctx = _parse_postbox(args)
    env = _environment(service)
    config = _host_path(service, env["POSTBOX_CONFIG"])
    assert config is not None
    policies = load_policies(config)
    if ctx.info_name == "worker":
        module_name, _, attr = ctx.params["app"].partition(":")
        registry = getattr(importlib.import_module(module_name), attr)
        assert isinstance(registry, Registry)
        assert ctx.params["consumer"] in registry.consumers()
    if ctx.info_name == "relay":
        destinations = list(ctx.params["destinations"])
        transports = build_transports(policies, destinations, env["POSTBOX_DATABASE_URL"])
        for destination in transports:
            url = getattr(policies.destinations[destination], "url", None)
            if url and urlsplit(url).hostname not in (None, "127.0.0.1", "localhost"):
                assert urlsplit(url).hostname in _depends_on(service), f"relay needs {url}"
    if ctx.info_name == "bridge":
        assert urlsplit(ctx.params["source_url"]).hostname in _depends_on(service)


def test_services_serving_metrics_listen_on_every_interface_explicitly():
    """Metrics listen on 127.0.0.1 by default, which other containers cannot reach: a service that
    serves them says ``--metrics-host 0.0.0.0`` (or POSTBOX_METRICS_HOST) itself."""
    serving = []
    for name in POSTBOX_SERVICES:
        service = SERVICES[name]
        group = _parse_postbox(_command(service)).parent
        assert group is not None
        env = _environment(service)
        port = group.params["metrics_port"] or int(env.get("POSTBOX_METRICS_PORT", "0"))
        if port:
            serving.append(name)
            host = group.params["metrics_host"] or env.get("POSTBOX_METRICS_HOST")
            assert host == "0.0.0.0", f"{name} serves metrics on 127.0.0.1 only"
    assert serving, "no service serves metrics"


def _metrics_port(name: str) -> int:
    group = _parse_postbox(_command(SERVICES[name])).parent
    assert group is not None
    return int(group.params["metrics_port"] or _environment(SERVICES[name]).get("POSTBOX_METRICS_PORT", 0))


@pytest.mark.parametrize("name", RUNNING_SERVICES)
def test_every_running_postbox_service_serves_metrics_and_is_healthy_when_ready(name):
    """Each long-running Postbox service serves metrics (on every interface, see above) and its
    healthcheck asks its own /readyz on that port with the image's python (no curl there)."""
    port = _metrics_port(name)
    assert port, f"{name} serves no metrics"
    test = SERVICES[name].get("healthcheck", {}).get("test")
    assert test and test[:3] == ["CMD", "python", "-c"], f"{name}: healthcheck {test!r}"
    assert f"urlopen('http://127.0.0.1:{port}/readyz'" in test[3], test[3]


# What each kind of process needs, as a Postbox group role (docs/operations.md, "Roles").
ROLE_OF = {
    "worker": "postbox_worker",
    "relay": "postbox_worker",
    "bridge": "postbox_worker",
    "maintain": "postbox_maintainer",
    "replay": "postbox_operator",
    "console": "postbox_operator",
    "migrate": None,  # the owner of the schema
}
GROUPS = ("postbox_producer", "postbox_worker", "postbox_maintainer", "postbox_operator", "postbox_reader")


def test_every_postbox_service_connects_as_its_own_least_privileged_login(compose_database):
    """After the compose init scripts, each service's login exists, is no superuser, and is in
    exactly the Postbox role its command needs (the migration's login in none: it owns the schema);
    worker, relay and bridge have logins of their own."""
    users = {}
    with compose_database.connect(autocommit=True) as c:
        for name in POSTBOX_SERVICES:
            kind = _subcommand(name)
            user = urlsplit(_environment(SERVICES[name])["POSTBOX_DATABASE_URL"]).username
            row = c.execute(
                "SELECT rolsuper, rolcanlogin FROM pg_roles WHERE rolname = %s", (user,)
            ).fetchone()
            assert row == (False, True), f"{name}: login {user!r} missing or a superuser: {row}"
            member = [
                g
                for g in GROUPS
                if c.execute("SELECT pg_has_role(%s, %s, 'MEMBER')", (user, g)).fetchone()[0]
            ]
            expected = [ROLE_OF[kind]] if ROLE_OF[kind] else []
            assert member == expected, f"{name} ({kind}) connects as {user}, in {member}, not {expected}"
            users[name] = user
    assert len({users[n] for n in ("relay", "bridge", "worker-orders")}) == 3


def _prometheus_targets() -> list[tuple[str, str, int]]:
    """(job, compose service, port) of every scrape target of deploy/prometheus/prometheus.yml."""
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text(encoding="utf-8"))
    targets = []
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                targets.append((job["job_name"], host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            assert dns.get("type", "SRV") == "A", "compose's DNS answers A queries"
            targets += [(job["job_name"], host, int(dns["port"])) for host in dns["names"]]
    return targets


def test_prometheus_scrapes_every_postbox_service_at_its_metrics_port():
    """The monitoring profile's Prometheus loads deploy/prometheus (config and the shipped rules,
    through its mount); every scrape target is a Postbox service at the port it serves metrics on,
    and every running Postbox service is scraped."""
    service = SERVICES["prometheus"]
    assert service.get("profiles") == ["monitoring"]
    flag = next(a for a in service["command"] if a.startswith("--config.file="))
    config = _host_path(service, flag.split("=", 1)[1])
    assert config == REPO / "deploy/prometheus/prometheus.yml"
    rules = yaml.safe_load(config.read_text(encoding="utf-8"))["rule_files"]
    assert [(config.parent / r).resolve() for r in rules] == [REPO / "deploy/prometheus/alerts.yml"]
    targets = _prometheus_targets()
    for job, host, port in targets:
        assert host in POSTBOX_SERVICES, f"{job}: {host} is not a Postbox service of docker-compose.yml"
        assert port == _metrics_port(host), (
            f"{job}: {host} serves metrics on {_metrics_port(host)}, not {port}"
        )
    assert sorted({host for _, host, _ in targets}) == sorted(RUNNING_SERVICES)


def test_promtool_accepts_the_prometheus_config():
    """``promtool check config deploy/prometheus/prometheus.yml`` (it also checks the rule files)."""
    done = subprocess.run(
        [promtool(), "check", "config", "deploy/prometheus/prometheus.yml"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_provisions_the_prometheus_datasource_and_the_shipped_dashboard():
    """Grafana's provisioning files are mounted; the datasource is the compose Prometheus (default,
    the type the dashboard's datasource variable asks for); the dashboards provider reads a folder
    that the mounts fill with the shipped deploy/grafana/postbox.json."""
    service = SERVICES["grafana"]
    assert service.get("profiles") == ["monitoring"]
    provisioning = _host_path(service, "/etc/grafana/provisioning")
    assert provisioning is not None and provisioning.is_dir()
    files = sorted(provisioning.rglob("*.yml"))
    assert {f.parent.name for f in files} == {"datasources", "dashboards"}
    dashboard = json.loads((REPO / "deploy/grafana/postbox.json").read_text(encoding="utf-8"))
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    for file in files:
        content = yaml.safe_load(file.read_text(encoding="utf-8"))
        assert content["apiVersion"] == 1
        for source in content.get("datasources", []):
            url = urlsplit(source["url"])
            assert source["type"] == variable["query"] and source["isDefault"]
            assert url.hostname == "prometheus" and url.port == 9090
            assert "9090:9090" in SERVICES["prometheus"]["ports"]
        for provider in content.get("providers", []):
            folder = PurePosixPath(provider["options"]["path"])
            mounted = [host for host, target in _bind_mounts(service) if folder in target.parents]
            assert mounted == [REPO / "deploy/grafana/postbox.json"], f"{folder}: {mounted}"


def test_optional_services_are_in_profiles_no_default_service_needs():
    """Prometheus and Grafana are in the profile monitoring, the Kafka-compatible broker (tansu) in
    the profile kafka; no service started by default depends on a service of a profile."""
    kafka = SERVICES["kafka"]
    assert kafka["image"].startswith("ghcr.io/tansu-io/tansu") and kafka["profiles"] == ["kafka"]
    assert kafka["command"][0] == "broker" and "tcp://kafka:9092" in kafka["command"]
    profiled = {name for name, service in SERVICES.items() if service.get("profiles")}
    assert profiled == {"prometheus", "grafana", "kafka"}
    for name, service in SERVICES.items():
        if not service.get("profiles"):
            assert not set(_depends_on(service)) & profiled, f"{name} depends on an optional service"


@pytest.mark.parametrize(
    "args",
    [
        ["wrker", "--consumer", "orders"],
        ["worker", "--consumer", "orders", "--no-such-option", "1"],
        ["worker", "--app", "postbox.examples.orders:registry"],
        ["worker", "--consumer", "orders", "--concurrency", "zero"],
        ["relay", "--destinaton", "shipping"],
        ["bridge", "--from", "amqp://rabbitmq", "--name", "shipping"],
    ],
)
def test_the_command_check_refuses_what_postbox_would_refuse(args):
    """The check itself is not lenient: a misspelt command or option, a missing required option
    or a bad value is a usage error."""
    with pytest.raises(click.UsageError):
        _parse_postbox(args)


# --- the Dockerfile ---------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _copied() -> list[str]:
    sources = []
    for instruction, rest in _dockerfile():
        if instruction in ("COPY", "ADD"):
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            sources += parts[:-1]
    return sources


def test_dockerfile_builds_a_non_root_python_311_image_of_the_postbox_command():
    """python:3.11-slim, installs the package, runs as a user other than root, and its
    ENTRYPOINT is the ``postbox`` script that pyproject.toml declares."""
    instructions = _dockerfile()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    installs = [
        r
        for i, r in instructions
        if i == "RUN" and re.search(r"pip install (\S+ )*[\"']?\.(\[[a-z,]+\])?[\"']?(\s|$)", r)
    ]
    assert installs, "the image installs the package from the build context"
    assert not any("embedded" in r or "pgserver" in r for r in installs), (
        "the image has no embedded PostgreSQL"
    )
    users = [r for i, r in instructions if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (entrypoint,) = [r for i, r in instructions if i == "ENTRYPOINT"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert json.loads(entrypoint) == ["postbox"] and "postbox" in scripts


def test_dockerfile_copies_what_the_package_build_needs_and_dockerignore_keeps_it():
    """Every COPY source exists in the build context and is not excluded by .dockerignore, and
    the files the wheel is built from (pyproject, readme, packages, force-included data) are copied."""
    ignored = _dockerignore()
    sources = _copied()
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the build context"
        top = source.strip("./").split("/")[0]
        assert top not in ignored, f"COPY {source}, but .dockerignore excludes it"
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    hatch = project["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {"pyproject.toml", project["project"]["readme"], *hatch["packages"], *hatch["force-include"]}
    copied = {s.rstrip("/") for s in sources}
    missing = {n for n in needed if not any(n == c or n.startswith(c + "/") for c in copied)}
    assert not missing, missing
    assert ".venv" in ignored and ".git" in ignored


def _readme_section() -> str:
    manual = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    return manual.split("\n## Running with docker compose\n", 1)[1].split("\n## ", 1)[0]


def _readme_sql() -> tuple[str, list[str]]:
    """The README's producer statement (the psql here-document) and its queries (``psql -c``)."""
    section = _readme_section()
    produce = re.search(r"psql -U postbox <<'SQL'\n(.*?)\nSQL\n", section, re.DOTALL)
    assert produce, "the README's compose section has no psql here-document"
    return produce.group(1), re.findall(r'-c "([^"]+)"', section)


def test_the_readme_compose_commands_name_real_services_and_users():
    """The README's docker compose commands use services of the file and the database user that the
    compose PostgreSQL creates (its default database has the user's name)."""
    section = _readme_section()
    used = set(
        re.findall(r"docker compose exec -T (\S+)", section) + re.findall(r"--scale ([\w-]+)=", section)
    )
    assert used and used <= set(SERVICES), used - set(SERVICES)
    env = _environment(SERVICES["postgres"])
    assert env["POSTGRES_USER"] == env["POSTGRES_DB"]
    assert set(re.findall(r"psql -U (\S+)", section)) == {env["POSTGRES_USER"]}


# --- the compose command lines, run -----------------------------------------------------------


def _stop(process: subprocess.Popen[bytes]) -> str:
    """SIGTERM, as ``docker compose stop`` sends; the process must exit within the grace period."""
    process.send_signal(signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return stderr.decode(errors="replace")


@pytest.fixture
def compose_database(database) -> Any:
    """The test database with the example's business tables, created by the same init scripts the
    compose PostgreSQL runs at its first start."""
    scripts = sorted(_host_path(SERVICES["postgres"], "/docker-entrypoint-initdb.d").glob("*.sql"))
    assert scripts
    with database.connect(autocommit=True) as c:
        for script in scripts:
            c.execute(script.read_text(encoding="utf-8"))
    return database


def _login_url(name: str, database: Database) -> str:
    """The service's database URL with its login (user and password) kept, pointed at ``database``."""
    login = urlsplit(_environment(SERVICES[name])["POSTBOX_DATABASE_URL"])
    assert login.username and login.password, f"{name}: no login in its database URL"
    params = dict(database.server.params, dbname=database.name, user=login.username, password=login.password)
    return _conninfo_url(params)


def _run_compose_service(
    name: str,
    database: Database,
    monkeypatch: pytest.MonkeyPatch,
    config: Path | None = None,
    replace: dict[str, str] | None = None,
    options: dict[str, str] | None = None,
    *,
    as_login: bool = False,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a compose service's exact command line with its environment, the database URL pointed
    at the test database (as the service's own login with ``as_login``, else as the test's
    superuser) and container paths mapped back to the mounted host files (or to ``config``);
    ``replace`` substitutes text in the arguments (broker hosts), ``options`` gives options other
    values (queue names). Its metrics move to a free port (every container has its own 9464; here
    they share one host): the process and that port."""
    service = SERVICES[name]
    for variable, value in _environment(service).items():
        host = _host_path(service, value) if value.startswith("/") else None
        monkeypatch.setenv(variable, str(host) if host else value)
    monkeypatch.setenv("POSTBOX_DATABASE_URL", _login_url(name, database) if as_login else database.url)
    if config is not None:
        monkeypatch.setenv("POSTBOX_CONFIG", str(config))
    args = _command(service)
    for old, new in (replace or {}).items():
        args = [a.replace(old, new) for a in args]
    port = free_port()
    for option, value in {"--metrics-port": str(port), **(options or {})}.items():
        args[args.index(option) + 1] = value
    return spawn_postbox(*args, stderr=subprocess.PIPE), port


def _healthy(name: str, port: int) -> bool:
    """The service's own healthcheck command (``python -c …``, its port moved to ``port``) succeeds."""
    test = SERVICES[name]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"], test
    code = [a.replace(f":{_metrics_port(name)}/", f":{port}/") for a in test[2:]]
    done = subprocess.run([sys.executable, *code], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def test_the_orders_worker_of_the_compose_file_processes_an_order(compose_database, monkeypatch):
    """worker-orders, as compose starts it, records a payment and writes the shipment request to
    the outbox in the same transaction; a malformed payment is dead-lettered, holding its order only."""
    url = compose_database.url
    with psycopg.connect(url) as c:
        receive(
            c,
            consumer="orders",
            message_id="o1-paid",
            key="order-1",
            type="order.paid",
            payload={"amount": 42},
        )
        receive(c, consumer="orders", message_id="o2-paid", key="order-2", type="order.paid", payload={})
        receive(c, consumer="orders", message_id="o3-new", key="order-3", type="order.created", payload={})
        c.commit()
    worker, port = _run_compose_service("worker-orders", compose_database, monkeypatch)
    try:

        def settled() -> Any:
            assert worker.poll() is None, worker.stderr.read().decode() if worker.stderr else ""
            with psycopg.connect(url, autocommit=True) as c:
                orders = dict(c.execute("SELECT order_id, state FROM example_orders").fetchall())
                outbox = c.execute(
                    "SELECT destination, message_id, key, type, payload FROM postbox.outbox"
                ).fetchall()
                dead = c.execute("SELECT message_id FROM postbox.dead_letters").fetchall()
            return (orders, outbox, dead) if len(orders) == 2 and dead else None

        orders, outbox, dead = eventually(settled, timeout=60, what="worker-orders processed the orders")
        assert _healthy("worker-orders", port)
    finally:
        _stop(worker)
    assert orders == {"order-1": "paid", "order-3": "created"}
    assert outbox == [
        (
            "shipping",
            "o1-paid:shipment",
            "order-1",
            "shipment.requested",
            {"order_id": "order-1", "amount": 42},
        )
    ]
    assert dead == [("o2-paid",)]
    assert worker.returncode == 0


def test_the_shipping_worker_of_the_compose_file_records_a_shipment(compose_database, monkeypatch):
    """worker-shipping, as compose starts it, records the shipment the bridge delivered."""
    url = compose_database.url
    with psycopg.connect(url) as c:
        receive(
            c,
            consumer="shipping",
            message_id="o1-paid:shipment",
            key="order-1",
            type="shipment.requested",
            payload={"order_id": "order-1", "amount": 42},
        )
        c.commit()
    worker, port = _run_compose_service("worker-shipping", compose_database, monkeypatch)
    try:

        def shipped() -> Any:
            assert worker.poll() is None, worker.stderr.read().decode() if worker.stderr else ""
            with psycopg.connect(url, autocommit=True) as c:
                return c.execute("SELECT order_id, request_id FROM example_shipments").fetchall()

        shipments = eventually(shipped, timeout=60, what="worker-shipping recorded the shipment")
        assert _healthy("worker-shipping", port)
    finally:
        _stop(worker)
    assert shipments == [("order-1", "o1-paid:shipment")]
    assert worker.returncode == 0


@pytest.mark.parametrize("name", RUNNING_SERVICES)
def test_every_running_service_becomes_healthy_as_its_login(name, compose_database, monkeypatch, tmp_path):
    """Each long-running service of the compose file, its command line run as its own login (the
    brokers mapped to this machine's, the bridge's queue renamed), passes its own healthcheck (its
    /readyz) and stops cleanly on SIGTERM."""
    config, replace, queue = _local_brokers(tmp_path)
    options = {"--name": queue} if _subcommand(name) == "bridge" else {}
    process, port = _run_compose_service(
        name, compose_database, monkeypatch, config, replace, options, as_login=True
    )
    try:

        def healthy() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"{name} exited: {process.communicate()[1].decode()}")
            return _healthy(name, port)

        eventually(healthy, timeout=60, interval=0.2, what=f"{name} healthy")
    finally:
        errors = _stop(process)
        _delete_queue(queue)
    assert process.returncode == 0, errors


COMPOSE_BROKER, LOCAL_BROKER = "@rabbitmq:5672/", "@127.0.0.1:5672/"


def _local_brokers(tmp_path: Path) -> tuple[Path, dict[str, str], str]:
    """The compose config file with RabbitMQ at this machine's and the destination's queue renamed
    (unique to the test), the argument substitutions that do the same on a command line, and the
    queue."""
    queue = f"shipping-test-{uuid.uuid4().hex[:12]}"
    original = _host_path(SERVICES["relay"], _environment(SERVICES["relay"])["POSTBOX_CONFIG"])
    assert original is not None
    text = original.read_text(encoding="utf-8")
    assert COMPOSE_BROKER in text and 'routing_key = "shipping"' in text
    config = tmp_path / "postbox.toml"
    config.write_text(
        text.replace(COMPOSE_BROKER, LOCAL_BROKER).replace(
            'routing_key = "shipping"', f'routing_key = "{queue}"'
        )
    )
    return config, {COMPOSE_BROKER: LOCAL_BROKER}, queue


def _delete_queue(queue: str) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F"))
    connection.channel().queue_delete(queue)
    connection.close()


def test_the_compose_pipeline_turns_a_paid_order_into_a_shipment(compose_database, monkeypatch, tmp_path):
    """worker-orders, relay, bridge and worker-shipping, started with their compose command lines
    and config file (the host ``rabbitmq`` mapped to the machine's RabbitMQ, the queue renamed for
    this test): the README's order event goes inbox -> outbox -> RabbitMQ -> inbox and ends as one
    shipment, seen by the README's queries."""
    url = compose_database.url
    config, replace, queue = _local_brokers(tmp_path)
    # In compose order: the workers first (they declare their consumers), then relay and bridge.
    names = ["worker-shipping", "worker-orders", "relay", "bridge"]
    produce, queries = _readme_sql()
    with psycopg.connect(url, autocommit=True) as c:  # as psql runs the README's statement
        assert c.execute(produce).fetchall() == [("new",)]
    processes: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for name in names:
            if name == "relay":
                eventually(
                    lambda: scalar(url, "SELECT count(*) FROM postbox.consumers WHERE declared") == 2,
                    timeout=60,
                    what="the workers declared their consumers",
                )
            options = {"--name": queue} if name == "bridge" else {}
            process, port = _run_compose_service(
                name, compose_database, monkeypatch, config, replace, options
            )
            processes.append(process)
            ports.append(port)

        def shipped() -> Any:
            for name, process in zip(names, processes, strict=True):
                assert process.poll() is None, f"{name} exited: {process.communicate()[1].decode()}"
            with psycopg.connect(url, autocommit=True) as c:
                return c.execute("SELECT order_id, request_id FROM example_shipments").fetchall()

        shipments = eventually(shipped, timeout=90, what="the shipment reached worker-shipping")
        unhealthy = [name for name, port in zip(names, ports, strict=True) if not _healthy(name, port)]
        assert not unhealthy, f"healthcheck fails for {unhealthy}"
    finally:
        errors = [_stop(p) for p in processes]
        _delete_queue(queue)
    assert shipments == [("order-1", "order-1-paid:shipment")]
    with psycopg.connect(url, autocommit=True) as c:
        assert [c.execute(q).fetchall() for q in queries] == [
            [("order-1", "paid", 42)],
            [("order-1", "order-1-paid:shipment")],
        ]
    assert [p.returncode for p in processes] == [0, 0, 0, 0], errors
    with psycopg.connect(url, autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM postbox.outbox").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM postbox.inbox").fetchone() == (0,)
