"""Configuration from the environment (``POSTBOX_…``) and an optional TOML file.

Precedence: explicit arguments, then environment variables, then the file named by
``POSTBOX_CONFIG`` (or ``--config``), then defaults.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from service.errors import ConfigError

__all__ = ["Settings", "load_settings", "mask_url", "sqlalchemy_url"]


class Settings(BaseSettings):
    """Process settings. Every field can be set as ``POSTBOX_<NAME>`` or in the TOML file."""

    model_config = SettingsConfigDict(env_prefix="POSTBOX_", extra="forbid")

    database_url: SecretStr | None = Field(
        default=None,
        description="PostgreSQL URL; when unset, an embedded PostgreSQL (pgserver) is started.",
    )
    embedded_data_dir: Path = Field(
        default=Path(".pgdata"), description="Data folder of the embedded PostgreSQL."
    )
    config: Path | None = Field(default=None, description="TOML file with further settings.")
    dedup_retention_seconds: float = Field(
        default=7 * 86400.0, gt=0, description="How long a processed message id is remembered."
    )
    replay_window_seconds: float = Field(
        default=86400.0, ge=0, description="How long after dead-lettering a replay is expected."
    )
    # Observability and maintenance (service/metrics.py, service/logs.py, service/maintenance.py).
    log_format: Literal["auto", "json", "text"] = Field(
        default="auto", description="Log lines as JSON, text, or auto (text on a terminal, else JSON)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Level of the postbox loggers (debug adds a line per processed message)."
    )
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Port of /metrics, /healthz, /readyz (0: not served)."
    )
    metrics_host: str = Field(default="0.0.0.0", description="Address the metrics endpoint listens on.")  # noqa: S104
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

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    section = data.get("postbox", {})
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [postbox] must be a table")
    return section


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings, raising :class:`ConfigError` with every problem named."""
    try:
        env_only = Settings(**{k: v for k, v in overrides.items() if v is not None})
        path = config_file or env_only.config
        if path is None:
            return env_only
        from_file = _read_toml(path)
        explicit = {k: v for k, v in overrides.items() if v is not None}
        env_set = env_only.model_dump(exclude_unset=True)
        merged = {**from_file, **env_set, **explicit, "config": path}
        return Settings.model_validate(merged)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in error.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None


def sqlalchemy_url(url: str) -> str:
    """The same URL with SQLAlchemy's psycopg 3 driver name."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ConfigError("database_url must start with postgresql://")


def mask_url(url: str) -> str:
    """The URL with its password replaced, for logs and messages."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url
