"""The models behind the policy tables of the configuration file (``[consumers.NAME]`` with its
``types``, ``[destinations.NAME]``, the handler sections), validated by pydantic with errors that
name the setting; :mod:`postbox.config.policies` loads them and applies them to a registry."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from postbox.config.masking import is_secret_name, register_secret
from postbox.failures.breaker import BreakerSettings
from postbox.failures.policy import RetryPolicy

__all__ = [
    "ConsumerPolicy",
    "DestinationConfig",
    "HandlerConfig",
    "HttpDestination",
    "HttpHandlerConfig",
    "KafkaDestination",
    "NatsDestination",
    "PoliciesConfig",
    "PostgresDestination",
    "RabbitMQDestination",
    "RedisDestination",
    "SqlHandlerConfig",
    "TypePolicy",
]

DAY = 86400.0
# librdkafka settings that hold secrets although their names do not say so.
KAFKA_SECRET_SETTINGS = frozenset({"ssl.key.pem", "ssl_key", "sasl.oauthbearer.config"})


class TypePolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    retry: dict[str, Any] | None = None
    on_dead_letter: Literal["block", "skip", "halt"] | None = None
    idempotent: bool | None = None
    timeout: float | None = Field(default=None, gt=0)


class SqlHandlerConfig(BaseModel):
    """A PostgreSQL function ``schema.function(message jsonb, context jsonb)`` as the handler, or
    with ``batch``, ``schema.function(messages jsonb, contexts jsonb)`` as a batch handler."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sql"]
    function: str = Field(min_length=1)
    idempotent: bool = False
    timeout: float | None = Field(default=None, gt=0)
    batch: bool = Field(
        default=False,
        description="call the function once for the messages of a claimed batch, as "
        "function(messages jsonb, contexts jsonb) with one array element per message",
    )
    database_only: bool = Field(
        default=True,
        description="the function's effects are all in the database, so the messages of a batch it "
        "takes one after the other may share one savepoint; false for a function that reaches outside "
        "it (dblink, an HTTP extension)",
    )


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


class KafkaDestination(_Destination):
    """Produce to a Kafka topic (default: the destination's name; ``{type}`` in it is the message
    type) with an idempotent producer and ``acks=all``. ``settings`` are librdkafka settings, passed
    through (``security.protocol``, ``sasl.*``, ``ssl.*``, ``linger.ms``...); secret ones are masked."""

    kind: Literal["kafka"]
    bootstrap_servers: str = Field(default="127.0.0.1:9092", min_length=1)
    topic: str | None = Field(default=None, pattern=r"^([A-Za-z0-9._-]|\{type\})+$")
    settings: dict[str, str | int | float | bool] = Field(default_factory=dict)
    sasl_password_env: str | None = Field(
        default=None, description="environment variable holding sasl.password"
    )
    ssl_key_password_env: str | None = Field(
        default=None, description="environment variable holding ssl.key.password"
    )

    @field_validator("settings")
    @classmethod
    def _guarantees_kept(cls, settings: dict[str, Any]) -> dict[str, Any]:
        for name, weaker in (("enable.idempotence", ("false", "0")), ("acks", ("0", "1"))):
            if str(settings.get(name, "")).lower() in weaker:
                raise ValueError(
                    f"{name} = {settings[name]!r} would weaken delivery: Postbox needs it as it sets it"
                )
        for name, value in settings.items():  # a private key's name does not say it is secret
            if isinstance(value, str) and (is_secret_name(name) or name in KAFKA_SECRET_SETTINGS):
                register_secret(value)
        return settings


class HttpDestination(_Destination):
    """POST each row to a webhook."""

    kind: Literal["http"]
    url: str = Field(pattern=r"^https?://")
    timeout: float = Field(default=10.0, gt=0)
    hmac_secret_env: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)


DestinationConfig = Annotated[
    PostgresDestination
    | RabbitMQDestination
    | NatsDestination
    | RedisDestination
    | KafkaDestination
    | HttpDestination,
    Field(discriminator="kind"),
]


class PoliciesConfig(BaseModel):
    """The policies part of :class:`postbox.config.settings.Settings` (``Settings.policies()``),
    built from settings already validated there (the allowed hosts included)."""

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
