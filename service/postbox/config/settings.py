"""All of Postbox's configuration in one model, on pydantic-settings.

Precedence: command-line flags (and explicit arguments), then environment variables
(``POSTBOX_…``), then the TOML file named by ``--config`` (or ``POSTBOX_CONFIG``), then defaults.
The file's ``[postbox]`` table holds the settings (``[postbox.worker]``, ``[postbox.relay]``… the
defaults of each command's options), its ``[consumers.NAME]`` and ``[destinations.NAME]`` tables
the per-consumer and per-destination policies (see :mod:`postbox.config.policies`).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterable
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from postbox.config.masking import (
    host_pattern,
    is_secret_name,
    mask_secrets,
    mask_text,
    mask_url,
    register_secret,
    register_secrets_in,
    register_url_secrets,
    split_hosts,
)
from postbox.config.policy_models import ConsumerPolicy, DestinationConfig, HandlerConfig, PoliciesConfig
from postbox.config.retry_tables import check_retry_tables, document_retry_problems
from postbox.config.urls import sqlalchemy_url
from postbox.errors import ConfigError

__all__ = [
    "BridgeOptions",
    "MaintainOptions",
    "RelayOptions",
    "ReplayRunOptions",
    "Settings",
    "WorkerOptions",
    "host_pattern",
    "is_secret_name",
    "load_settings",
    "mask_secrets",
    "mask_text",
    "mask_url",
    "register_secret",
    "register_url_secrets",
    "sqlalchemy_url",
]


# --- the defaults of the long-running commands' options ([postbox.worker], …) --------------------


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerOptions(_Options):
    """``postbox worker`` (``[postbox.worker]``)."""

    concurrency: int = Field(default=2, ge=1, le=256)
    batch_size: int = Field(default=20, ge=1, le=10_000)
    poll_interval: float = Field(default=1.0, ge=0.001)
    listen: bool = True
    handler_timeout: float = Field(default=30.0, ge=0.001)
    grace_period: float = Field(default=30.0, ge=0)
    heartbeat_interval: float = Field(default=5.0, ge=0.01)
    stale_after: float = Field(default=30.0, ge=0.02)
    lease: float | None = Field(default=None, ge=0.01)
    max_stuck_handlers: int | None = Field(default=None, ge=0)


class RelayOptions(_Options):
    """``postbox relay`` (``[postbox.relay]``)."""

    concurrency: int = Field(default=1, ge=1, le=64)
    batch_size: int = Field(default=100, ge=1, le=10_000)
    poll_interval: float = Field(default=1.0, ge=0.001)
    listen: bool = True
    lease: float = Field(default=60.0, ge=0.01)
    heartbeat_interval: float = Field(default=5.0, ge=0.01)
    stale_after: float = Field(default=30.0, ge=0.02)
    grace_period: float = Field(default=30.0, ge=0)


class BridgeOptions(_Options):
    """``postbox bridge`` (``[postbox.bridge]``)."""

    batch_size: int = Field(default=100, ge=1, le=10_000)


class MaintainOptions(_Options):
    """``postbox maintain`` (``[postbox.maintain]``)."""

    stale_after: float = Field(default=30.0, ge=0.02)


class ReplayRunOptions(_Options):
    """``postbox replay run`` (``[postbox.replay_run]``)."""

    poll_interval: float = Field(default=0.5, ge=0.01, le=60)


class ConsoleOptions(_Options):
    class User(_Options):
        role: Literal["viewer", "operator"] = "viewer"
        password_hash: SecretStr | None = None
        token_env: str | None = None

    users: dict[str, User] = Field(default_factory=dict)
    viewers_see_payloads: bool = False


class Settings(BaseSettings):
    """Process settings. Every field can be set as ``POSTBOX_<NAME>`` or in the TOML file."""

    model_config = SettingsConfigDict(env_prefix="POSTBOX_", extra="forbid")

    database_url: SecretStr | None = Field(
        default=None,
        description="PostgreSQL URL (every command needs one but the demo, which starts an embedded PostgreSQL without it).",
    )
    embedded_data_dir: Path = Field(
        default=Path(".pgdata"), description="Data folder of the demo's embedded PostgreSQL."
    )
    config: Path | None = Field(default=None, description="TOML file with further settings.")
    dedup_retention_seconds: float = Field(
        default=7 * 86400.0, gt=0, description="How long a processed message id is remembered."
    )
    replay_window_seconds: float = Field(
        default=86400.0, ge=0, description="How long after dead-lettering a replay is expected."
    )
    # Observability and maintenance (service/postbox/operations/metrics.py, service/postbox/operations/logs.py, service/postbox/operations/maintenance.py).
    log_format: Literal["auto", "json", "text"] = Field(
        default="auto", description="Log lines as JSON, text, or auto (text on a terminal, else JSON)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Level of the postbox loggers (debug adds a line per processed message)."
    )
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Port of /metrics, /healthz, /readyz (0: not served)."
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address the metrics endpoint listens on (0.0.0.0: every interface, to be scraped "
        "from other hosts or containers).",
    )
    db_metrics_interval_seconds: float = Field(
        default=15.0,
        ge=0,
        description="How often a process serving metrics reads the database gauges (0: never).",
    )
    attempts_retention_seconds: float = Field(
        default=30 * 86400.0,
        gt=0,
        description="How long failed-attempt history is kept (not for open dead letters).",
    )
    dead_letter_retention_seconds: float = Field(
        default=30 * 86400.0,
        gt=0,
        description="How long replayed, discarded and resolved dead letters are kept.",
    )
    maintenance_interval_seconds: float = Field(
        default=60.0, gt=0, description="Period of the retention jobs of `postbox maintain`."
    )
    maintenance_batch_size: int = Field(
        default=1000, ge=1, le=100_000, description="Rows a retention job deletes per transaction."
    )
    # Outbound HTTP (HTTP handlers and the HTTP transport; service/postbox/inbox/http_handlers.py).
    http_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts HTTP handlers and HTTP destinations may call: names, *.suffix wildcards, "
        "IP addresses or networks (CIDR). Empty: any host. In the environment: comma-separated.",
    )
    http_deny_private_networks: bool = Field(
        default=False,
        description="Refuse HTTP requests to loopback, private, link-local and other non-public "
        "addresses (checked on the addresses a name resolves to, at connection time).",
    )
    connect_timeout: float | None = Field(
        default=None,
        ge=0,
        description="Seconds a long-running process waits at start for an unreachable database "
        "(None: as long as it takes).",
    )
    worker: WorkerOptions = Field(default_factory=WorkerOptions)
    relay: RelayOptions = Field(default_factory=RelayOptions)
    bridge: BridgeOptions = Field(default_factory=BridgeOptions)
    maintain: MaintainOptions = Field(default_factory=MaintainOptions)
    replay_run: ReplayRunOptions = Field(default_factory=ReplayRunOptions)
    console: ConsoleOptions = Field(default_factory=ConsoleOptions)
    consumers: dict[str, ConsumerPolicy] = Field(default_factory=dict)  # the file's [consumers.NAME] and
    destinations: dict[str, DestinationConfig] = Field(default_factory=dict)  # [destinations.NAME] tables

    @field_validator("http_allowed_hosts", mode="before")
    @classmethod
    def _hosts_from_text(cls, value: Any) -> Any:
        return split_hosts(value)

    @field_validator("http_allowed_hosts")
    @classmethod
    def _hosts_valid(cls, value: list[str]) -> list[str]:
        return [host_pattern(h) for h in value]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        document = _DOCUMENT.get()
        if document is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, _TomlSource(settings_cls, *document))

    def policies(self) -> PoliciesConfig:
        """The per-consumer and per-destination policies, with the settings they depend on."""
        return PoliciesConfig(
            dedup_retention_seconds=self.dedup_retention_seconds,
            replay_window_seconds=self.replay_window_seconds,
            http_allowed_hosts=tuple(self.http_allowed_hosts),
            http_deny_private_networks=self.http_deny_private_networks,
            consumers=self.consumers,
            destinations=self.destinations,
        )


# --- the TOML file ------------------------------------------------------------------------------

# The file (or parsed document) the settings being built read: (path, document).
_DOCUMENT: ContextVar[tuple[Path | None, dict[str, Any] | None] | None] = ContextVar(
    "postbox_settings_document", default=None
)


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file, parsed; a missing or malformed file is a :class:`ConfigError` naming it."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


_FILE_TABLES = ("postbox", "consumers", "destinations")


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``candidates``, or nothing."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _setting_names(model: Any = None, seen: set[Any] | None = None) -> set[str]:
    """Every setting name the configuration models declare, at any depth."""
    model = model or Settings
    seen = seen if seen is not None else set()
    if model in seen:
        return set()
    seen.add(model)
    names: set[str] = set()
    for name, field in model.model_fields.items():
        names.add(name)
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                names |= _setting_names(t, seen)
            stack.extend(get_args(t))
    return names


def _as_settings(document: dict[str, Any], where: str) -> dict[str, Any]:
    """The file's ``[postbox]`` table with its ``[consumers]`` and ``[destinations]`` beside it;
    every secret it holds is registered for masking."""
    unknown = sorted(set(document) - set(_FILE_TABLES))
    if unknown:
        raise ConfigError(
            f"{where}: unknown section [{unknown[0]}]{did_you_mean(unknown[0], _FILE_TABLES)}; "
            f"a configuration file has {', '.join(f'[{t}]' for t in _FILE_TABLES)}"
        )
    section = document.get("postbox", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: [postbox] must be a table")
    register_secrets_in(document.get("consumers", {}))
    register_secrets_in(document.get("destinations", {}))
    data = dict(section)
    for table in ("consumers", "destinations"):
        if table in document:
            data[table] = document[table]
    return data


class _TomlSource(TomlConfigSettingsSource):
    """pydantic-settings' TOML source, reading Postbox's layout (see :func:`_as_settings`)."""

    def __init__(
        self, settings_cls: type[BaseSettings], path: Path | None, document: dict[str, Any] | None
    ) -> None:
        self._document = document
        self._path = path
        super().__init__(settings_cls, toml_file=path)

    def _read_files(self, files: Any, deep_merge: bool = False) -> dict[str, Any]:
        if self._document is not None:
            return _as_settings(self._document, "configuration")
        if self._path is None:
            return {}
        return _as_settings(read_toml(self._path), f"config file {self._path}")


def _problems(error: ValidationError, origin: dict[str, str]) -> str:
    out = []
    for e in error.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "settings"
        where = origin.get(str(e["loc"][0]) if e["loc"] else "", "")
        hint = did_you_mean(str(e["loc"][-1]), _setting_names()) if e["type"] == "extra_forbidden" else ""
        out.append(f"{loc}{f' ({where})' if where else ''}: {_message(e)}{hint}")
    return "; ".join(out)


def _message(e: Any) -> str:
    """A validation error's text; a destination or handler table without ``kind`` says what it takes."""
    if e["type"] == "union_tag_not_found":
        union = HandlerConfig if "handlers" in e["loc"] else DestinationConfig
        kinds = ", ".join(
            repr(get_args(m.model_fields["kind"].annotation)[0]) for m in get_args(get_args(union)[0])
        )
        given = " (not type)" if isinstance(e.get("input"), dict) and "type" in e["input"] else ""
        return f"no kind given: add kind = one of {kinds}{given}"
    return str(e["msg"]).removeprefix("Value error, ")


def _origins(path: Path | None, document: dict[str, Any] | None) -> dict[str, str]:
    """For error messages: where each top-level setting came from (a variable, or the file)."""
    origin: dict[str, str] = {}
    if path is not None and document is not None:
        for key in _as_settings(document, str(path)):
            origin[key] = str(path)
    for name in Settings.model_fields:
        if f"POSTBOX_{name.upper()}" in os.environ:
            origin[name] = f"POSTBOX_{name.upper()}"
    return origin


def load_settings(
    config_file: Path | None = None, *, document: dict[str, Any] | None = None, **overrides: Any
) -> Settings:
    """Build the settings from ``overrides`` (flags), the environment and the TOML file
    ``config_file`` (or ``POSTBOX_CONFIG``; or an already parsed ``document``), raising
    :class:`ConfigError` with every problem named by its setting (and where it came from)."""
    explicit = {k: v for k, v in overrides.items() if v is not None}
    for value in explicit.values():
        if isinstance(value, str):
            register_url_secrets(value)
    path = config_file or (Path(os.environ["POSTBOX_CONFIG"]) if os.environ.get("POSTBOX_CONFIG") else None)
    if document is None and path is not None:
        document = read_toml(path)
    if path is not None:
        explicit["config"] = path
    token = _DOCUMENT.set((path, document))
    try:
        settings = Settings(**explicit)
    except ValidationError as error:
        # The retry tables are checked after the rest: their problems are named here too, from the
        # file as written, so that one run of `config check` shows every problem.
        problems = [_problems(error, _origins(path, document)), *document_retry_problems(document)]
        raise ConfigError(f"invalid configuration: {'; '.join(problems)}") from None
    finally:
        _DOCUMENT.reset(token)
    check_retry_tables(settings.consumers, settings.destinations)
    if settings.database_url is not None:
        register_url_secrets(settings.database_url.get_secret_value())
    return settings
