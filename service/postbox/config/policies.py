"""Per-consumer and per-message-type policies from a TOML file, validated with errors that name the
setting, then applied to a handler registry.

    [consumers.billing]
    sequence_mode = "arrival"            # arrival | monotonic | gapless
    on_dead_letter = "block"             # block | skip | halt
    retry = { strategy = "exponential_full_jitter", base_delay = 1, max_delay = 300, max_attempts = 10 }
    breaker = { failure_ratio = 0.8, probe_interval = 5 }

    [consumers.billing.types."order.paid"]
    retry = { max_attempts = 5 }         # merged over the consumer's retry settings
    on_dead_letter = "skip"
    idempotent = true

Precedence: the file overrides what the handlers declare in Python, which overrides the defaults.

Outbound HTTP (HTTP handlers and HTTP destinations) follows ``http_allowed_hosts`` and
``http_deny_private_networks`` of ``[postbox]`` (or ``POSTBOX_HTTP_…`` variables, which win).
Every secret the file holds (URL passwords and tokens, secret header values) is registered for
masking as the file is loaded.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from postbox.config.settings import (
    host_pattern,
    is_secret_name,
    outbound_http_from_env,
    register_secret,
    register_url_secrets,
)
from postbox.errors import ConfigError
from postbox.failures.breaker import BreakerSettings
from postbox.failures.policy import RetryPolicy
from postbox.inbox.handlers import Registry

if TYPE_CHECKING:
    from postbox.inbox.http_handlers import OutboundPolicy

__all__ = [
    "ConsumerPolicy",
    "PoliciesConfig",
    "PostgresDestination",
    "TypePolicy",
    "apply_policies",
    "build_transports",
    "check_retention",
    "load_policies",
]

DAY = 86400.0


class TypePolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    retry: dict[str, Any] | None = None
    on_dead_letter: Literal["block", "skip", "halt"] | None = None
    idempotent: bool | None = None
    timeout: float | None = Field(default=None, gt=0)


class SqlHandlerConfig(BaseModel):
    """A PostgreSQL function ``schema.function(message jsonb, context jsonb)`` as the handler."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sql"]
    function: str = Field(min_length=1)
    idempotent: bool = False
    timeout: float | None = Field(default=None, gt=0)


class HttpHandlerConfig(BaseModel):
    """An HTTP endpoint as the handler: the message is POSTed as JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["http"]
    url: str = Field(pattern=r"^https?://")
    timeout: float = Field(default=10.0, gt=0, description="seconds per request")
    idempotent: bool = False
    hmac_secret_env: str | None = Field(
        default=None, description="environment variable holding the HMAC secret"
    )
    headers: dict[str, str] = Field(default_factory=dict)
    max_concurrency: int = Field(default=8, ge=1, le=1024)


HandlerConfig = Annotated[SqlHandlerConfig | HttpHandlerConfig, Field(discriminator="kind")]


class ConsumerPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sequence_mode: Literal["arrival", "monotonic", "gapless"] = "arrival"
    first_sequence: int = Field(default=1, ge=0)
    late_policy: Literal["dead_letter", "skip", "process"] = "dead_letter"
    on_dead_letter: Literal["block", "skip", "halt"] = "block"
    gap_timeout_seconds: float | None = Field(default=None, gt=0)
    retry: dict[str, Any] = Field(default_factory=dict)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    types: dict[str, TypePolicy] = Field(default_factory=dict)
    handlers: dict[str, HandlerConfig] = Field(
        default_factory=dict, description='handlers declared in the file, by message type ("*": every type)'
    )

    def retry_policy(self, type_: str | None = None) -> RetryPolicy:
        merged = dict(self.retry)
        if type_ is not None and type_ in self.types and self.types[type_].retry:
            merged.update(self.types[type_].retry or {})
        return RetryPolicy(**merged)


class _Destination(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    retry: dict[str, Any] = Field(default_factory=dict)
    on_dead_letter: Literal["block", "skip"] = "block"

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(**self.retry)


class PostgresDestination(_Destination):
    """Deliver into the inbox of ``consumer`` in the database at ``url`` (default: the relay's own)."""

    kind: Literal["postgres"]
    consumer: str = Field(min_length=1)
    url: str | None = None
    source: str | None = None


class RabbitMQDestination(_Destination):
    """Publish to RabbitMQ with confirms (default: a durable queue named after the destination)."""

    kind: Literal["rabbitmq"]
    url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"
    exchange: str = ""
    routing_key: str | None = None


class NatsDestination(_Destination):
    """Publish to a NATS JetStream subject (stream created if missing)."""

    kind: Literal["nats"]
    url: str = "nats://127.0.0.1:4222"
    subject: str | None = None
    stream: str | None = None


class RedisDestination(_Destination):
    """XADD to a Redis stream."""

    kind: Literal["redis"]
    url: str = "redis://127.0.0.1:6379/0"
    stream: str | None = None
    maxlen: int | None = Field(default=None, gt=0)


class HttpDestination(_Destination):
    """POST each row to a webhook."""

    kind: Literal["http"]
    url: str = Field(pattern=r"^https?://")
    timeout: float = Field(default=10.0, gt=0)
    hmac_secret_env: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)


DestinationConfig = Annotated[
    PostgresDestination | RabbitMQDestination | NatsDestination | RedisDestination | HttpDestination,
    Field(discriminator="kind"),
]


class PoliciesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dedup_retention_seconds: float = Field(default=7 * DAY, gt=0)
    replay_window_seconds: float = Field(default=1 * DAY, ge=0)
    http_allowed_hosts: tuple[str, ...] = Field(
        default=(), description="hosts HTTP handlers and destinations may call (empty: any)"
    )
    http_deny_private_networks: bool = Field(
        default=False, description="refuse HTTP requests to non-public addresses"
    )
    consumers: dict[str, ConsumerPolicy] = Field(default_factory=dict)
    destinations: dict[str, DestinationConfig] = Field(default_factory=dict)

    @field_validator("http_allowed_hosts", mode="before")
    @classmethod
    def _hosts_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):  # "a.example, b.example", as in the environment
            return [h.strip() for h in value.split(",") if h.strip()]
        return value

    @field_validator("http_allowed_hosts")
    @classmethod
    def _hosts_valid(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(host_pattern(h) for h in value)

    def outbound(self) -> OutboundPolicy:
        """The :class:`postbox.inbox.http_handlers.OutboundPolicy` of these settings."""
        from postbox.inbox.http_handlers import OutboundPolicy

        return OutboundPolicy(self.http_allowed_hosts, self.http_deny_private_networks)


def _errors(error: ValidationError, prefix: str = "") -> str:
    return "; ".join(
        f"{prefix}{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
        for e in error.errors()
    )


def load_policies(data: dict[str, Any] | Path | None) -> PoliciesConfig:
    """Policies from a parsed TOML document (or its path); every problem named by its setting path."""
    if data is None:
        return PoliciesConfig()
    if isinstance(data, Path):
        try:
            data = tomllib.loads(data.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file {data} does not exist") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {data} is not valid TOML: {error}") from None
    section = {
        k: v
        for k, v in data.get("postbox", {}).items()
        if k
        in (
            "dedup_retention_seconds",
            "replay_window_seconds",
            "http_allowed_hosts",
            "http_deny_private_networks",
        )
    }
    section.update(outbound_http_from_env())
    _register_secrets(data.get("consumers", {}))
    _register_secrets(data.get("destinations", {}))
    try:
        config = PoliciesConfig(
            consumers=data.get("consumers", {}), destinations=data.get("destinations", {}), **section
        )
    except ValidationError as error:
        raise ConfigError(f"invalid configuration: {_errors(error)}") from None
    for name, consumer in config.consumers.items():
        for type_ in (None, *consumer.types):
            try:
                consumer.retry_policy(type_)
            except ValidationError as error:
                where = f"consumers.{name}." + (f"types.{type_}." if type_ else "") + "retry."
                raise ConfigError(f"invalid configuration: {_errors(error, where)}") from None
    for name, dest in config.destinations.items():
        try:
            dest.retry_policy()
        except ValidationError as error:
            raise ConfigError(
                f"invalid configuration: {_errors(error, f'destinations.{name}.retry.')}"
            ) from None
    return config


def _register_secrets(value: Any, name: str = "") -> None:
    """Register for masking every secret of a parsed table: URLs' passwords, tokens and secret
    parameters in any string, and the values of settings and headers named like secrets."""
    if isinstance(value, dict):
        for k, v in value.items():
            _register_secrets(v, str(k))
    elif isinstance(value, list | tuple):
        for v in value:
            _register_secrets(v, name)
    elif isinstance(value, str):
        if is_secret_name(name):
            register_secret(value)
            register_secret(value.partition(" ")[2])  # "Bearer <token>"
        register_url_secrets(value)


def _secret(env_name: str | None, where: str) -> bytes | None:
    """An HMAC secret read from the environment variable the file names (never from the file)."""
    import os

    if env_name is None:
        return None
    value = os.environ.get(env_name)
    if not value:
        raise ConfigError(f"{where}.hmac_secret_env: environment variable {env_name} is not set")
    register_secret(value)
    return value.encode()


def build_transports(config: PoliciesConfig, names: list[str], own_url: str) -> dict[str, Any]:
    """Transport factories for the named destinations (all configured ones if ``names`` is empty):
    each relay loop calls its factory, so no broker client is shared between threads."""
    import functools
    import re

    from postbox.outbox.transports.brokers import (
        HttpTransport,
        NatsTransport,
        RabbitMQTransport,
        RedisStreamsTransport,
    )
    from postbox.outbox.transports.postgres import PostgresTransport

    outbound = config.outbound()
    wanted = names or sorted(config.destinations)
    if not wanted:
        raise ConfigError("no destination: declare [destinations.NAME] in the config file")
    transports: dict[str, Any] = {}
    for name in wanted:
        dest = config.destinations.get(name)
        if dest is None:
            raise ConfigError(
                f"destination {name!r} is not declared in the config file ([destinations.{name}])"
            )
        if isinstance(dest, PostgresDestination):
            transports[name] = functools.partial(
                PostgresTransport, dest.url or own_url, dest.consumer, dest.source
            )
        elif isinstance(dest, RabbitMQDestination):
            transports[name] = functools.partial(
                RabbitMQTransport, dest.url, dest.routing_key or name, dest.exchange
            )
        elif isinstance(dest, NatsDestination):
            stream = dest.stream or "POSTBOX_" + re.sub(r"[^A-Za-z0-9_-]", "_", name).upper()
            transports[name] = functools.partial(
                NatsTransport, dest.url, dest.subject or f"postbox.{name}", stream
            )
        elif isinstance(dest, RedisDestination):
            transports[name] = functools.partial(
                RedisStreamsTransport, dest.url, dest.stream or f"postbox:{name}", dest.maxlen
            )
        else:
            secret = _secret(dest.hmac_secret_env, f"destinations.{name}")
            transports[name] = functools.partial(
                HttpTransport, dest.url, dest.timeout, secret, dest.headers, outbound=outbound
            )
    return transports


def apply_policies(registry: Registry, config: PoliciesConfig) -> Registry:
    """A copy of ``registry`` with the file's retry, dead-letter and idempotency settings applied."""
    out = Registry(
        dict(registry.handlers), dict(registry.retry_policies), list(registry.rules), list(registry.listeners)
    )
    for consumer, policy in config.consumers.items():
        out.retry_policies[consumer] = policy.retry_policy()
        for type_, tp in policy.types.items():
            spec = out.lookup(consumer, type_)
            if spec is None:
                raise ConfigError(f"consumers.{consumer}.types.{type_}: no handler is registered for it")
            out.handlers[(consumer, type_)] = dataclasses.replace(
                spec,
                type=type_,
                retry=policy.retry_policy(type_) if tp.retry else spec.retry,
                on_dead_letter=tp.on_dead_letter or spec.on_dead_letter,
                idempotent=spec.idempotent if tp.idempotent is None else tp.idempotent,
                timeout=tp.timeout or spec.timeout,
            )
        for (c, t), spec in list(out.handlers.items()):
            if c == consumer and spec.on_dead_letter is None and policy.on_dead_letter != "block":
                out.handlers[(c, t)] = dataclasses.replace(spec, on_dead_letter=policy.on_dead_letter)
    return out


def check_retention(config: PoliciesConfig, registry: Registry, default: RetryPolicy) -> None:
    """Refuse a deduplication window shorter than the longest retry horizon plus the replay window:
    a redelivery after that could be taken for a new message."""
    policies = [default, *registry.retry_policies.values()]
    policies += [s.retry for s in registry.handlers.values() if s.retry is not None]
    horizon = max(p.horizon_seconds() for p in policies)
    needed = horizon + config.replay_window_seconds
    if config.dedup_retention_seconds < needed:
        raise ConfigError(
            f"dedup_retention_seconds ({config.dedup_retention_seconds:g}) is shorter than the longest retry "
            f"horizon ({horizon:g} s) plus replay_window_seconds ({config.replay_window_seconds:g}): "
            f"a late redelivery could be processed twice. Raise it to at least {needed:g}."
        )


def configured_handlers(registry: Registry, config: PoliciesConfig, consumer: str) -> Registry:
    """``registry`` plus the SQL-function and HTTP handlers the file declares for ``consumer``."""

    from postbox.inbox.http_handlers import HttpEndpoint
    from postbox.inbox.sql_handlers import sql_function_handler

    policy = config.consumers.get(consumer)
    if policy is None or not policy.handlers:
        return registry
    out = Registry(
        dict(registry.handlers), dict(registry.retry_policies), list(registry.rules), list(registry.listeners)
    )
    for type_, h in policy.handlers.items():
        where = f"consumers.{consumer}.handlers.{type_}"
        message_type = None if type_ == "*" else type_
        if (consumer, message_type) in out.handlers:
            raise ConfigError(f"{where}: a Python handler is registered for it already")
        if isinstance(h, SqlHandlerConfig):
            out.add(
                sql_function_handler(h.function),
                consumer,
                message_type,
                idempotent=h.idempotent,
                timeout=h.timeout,
            )
        else:
            secret = _secret(h.hmac_secret_env, where)
            endpoint = HttpEndpoint(
                h.url,
                timeout=h.timeout,
                secret=secret,
                headers=h.headers,
                max_concurrency=h.max_concurrency,
                outbound=config.outbound(),
            )
            out.add(endpoint, consumer, message_type, idempotent=h.idempotent, timeout=h.timeout + 5.0)
    return out


def sql_functions(config: PoliciesConfig, consumer: str) -> list[str]:
    """The SQL-function handlers declared for ``consumer`` (checked to exist at start-up)."""
    policy = config.consumers.get(consumer)
    if policy is None:
        return []
    return [h.function for h in policy.handlers.values() if isinstance(h, SqlHandlerConfig)]
