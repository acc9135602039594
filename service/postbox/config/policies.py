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
from pathlib import Path
from typing import Any

from postbox.config.masking import register_secret
from postbox.config.policy_models import (
    ConsumerPolicy,
    DestinationConfig,
    HttpDestination,
    HttpHandlerConfig,
    KafkaDestination,
    NatsDestination,
    PoliciesConfig,
    PostgresDestination,
    RabbitMQDestination,
    RedisDestination,
    SqlHandlerConfig,
    TypePolicy,
)
from postbox.config.settings import load_settings, mask_text
from postbox.errors import ConfigError
from postbox.failures.policy import RetryPolicy
from postbox.inbox.handlers import Registry

__all__ = [
    "ConsumerPolicy",
    "DestinationConfig",
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
    "apply_policies",
    "build_transports",
    "check_file_retention",
    "check_kafka_settings",
    "check_retention",
    "configured_handlers",
    "kafka_settings_problems",
    "load_policies",
    "missing_secrets",
    "retention_needed",
    "sql_functions",
]


def load_policies(data: dict[str, Any] | Path | None) -> PoliciesConfig:
    """The policies of a TOML file (its path, or the parsed document), with the environment's
    ``POSTBOX_…`` settings over the file's: the policies part of :func:`load_settings`. Every problem
    is named by its setting path."""
    if data is None:
        return PoliciesConfig()
    if isinstance(data, Path):
        return load_settings(data).policies()
    return load_settings(document=data).policies()


def _secret(env_name: str | None, where: str, setting: str = "hmac_secret_env") -> bytes | None:
    """A secret read from the environment variable the file names in ``setting`` (never from the
    file)."""
    import os

    if env_name is None:
        return None
    value = os.environ.get(env_name)
    if not value:
        raise ConfigError(f"{where}.{setting}: environment variable {env_name} is not set")
    register_secret(value)
    return value.encode()


def build_transports(config: PoliciesConfig, names: list[str], own_url: str) -> dict[str, Any]:
    """Transport factories for the named destinations (all configured ones if ``names`` is empty):
    each relay loop calls its factory, so no broker client is shared between threads."""
    import functools
    import re

    from postbox.outbox.transports import transport_class
    from postbox.outbox.transports.http import OutboundPolicy

    outbound = OutboundPolicy(config.http_allowed_hosts, config.http_deny_private_networks)
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
                transport_class("postgres"), dest.url or own_url, dest.consumer, dest.source
            )
        elif isinstance(dest, RabbitMQDestination):
            transports[name] = functools.partial(
                transport_class("rabbitmq"), dest.url, dest.routing_key or name, dest.exchange
            )
        elif isinstance(dest, NatsDestination):
            stream = dest.stream or "POSTBOX_" + re.sub(r"[^A-Za-z0-9_-]", "_", name).upper()
            transports[name] = functools.partial(
                transport_class("nats"), dest.url, dest.subject or f"postbox.{name}", stream
            )
        elif isinstance(dest, RedisDestination):
            transports[name] = functools.partial(
                transport_class("redis"), dest.url, dest.stream or f"postbox:{name}", dest.maxlen
            )
        elif isinstance(dest, KafkaDestination):
            settings: dict[str, Any] = dict(dest.settings)
            for setting, env in (
                ("sasl.password", dest.sasl_password_env),
                ("ssl.key.password", dest.ssl_key_password_env),
            ):
                secret_value = _secret(env, f"destinations.{name}", f"{setting.replace('.', '_')}_env")
                if secret_value is not None:
                    settings[setting] = secret_value.decode()
            transports[name] = functools.partial(
                transport_class("kafka"), dest.bootstrap_servers, dest.topic or name, settings
            )
        else:
            secret = _secret(dest.hmac_secret_env, f"destinations.{name}")
            transports[name] = functools.partial(
                transport_class("http"), dest.url, dest.timeout, secret, dest.headers, outbound=outbound
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
    _check_horizon(config, _registry_policies(registry, default))


def retention_needed(config: PoliciesConfig, registry: Registry, default: RetryPolicy) -> tuple[float, float]:
    """The longest retry horizon of ``registry``'s handlers, and the deduplication window they need
    (that horizon plus the replay window), in seconds."""
    horizon = max(p.horizon_seconds() for p in _registry_policies(registry, default))
    return horizon, horizon + config.replay_window_seconds


def _registry_policies(registry: Registry, default: RetryPolicy) -> list[RetryPolicy]:
    policies = [default, *registry.retry_policies.values()]
    return policies + [s.retry for s in registry.handlers.values() if s.retry is not None]


def check_kafka_settings(config: PoliciesConfig, transports: dict[str, Any]) -> None:
    """Make a producer now with each Kafka destination's settings, so that a relay refuses at start
    what librdkafka refuses (a CA file that is not there, a value it does not take) rather than fail
    every row with it: :class:`ConfigError` naming the destination and librdkafka's reason."""
    for name, make in transports.items():
        if not isinstance(config.destinations.get(name), KafkaDestination):
            continue
        reason = _kafka_refusal(make)
        if reason is not None:
            raise ConfigError(f"destinations.{name}.settings: librdkafka refuses them: {reason}")


def kafka_settings_problems(config: PoliciesConfig) -> list[str]:
    """What librdkafka refuses here of each Kafka destination's settings, for ``config check`` to
    warn of (the files they name may be on the relay's machine only). A destination whose secret is
    not set here is left out (its warning says so), and without the kafka extra nothing is checked."""
    names = [n for n, d in config.destinations.items() if isinstance(d, KafkaDestination)]
    if not names:
        return []
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return [
            "Kafka destinations' settings not checked: the kafka extra (confluent-kafka) is not installed here"
        ]
    problems = []
    for name in names:
        try:
            make = build_transports(config, [name], "")[name]
        except ConfigError:  # a secret not set here: missing_secrets names it
            continue
        reason = _kafka_refusal(make)
        if reason is not None:
            problems.append(f"destinations.{name}.settings: librdkafka refuses them here: {reason}")
    return problems


def _kafka_refusal(make: Any) -> str | None:
    """librdkafka's reason for refusing the settings of the Kafka transport ``make`` builds, if any."""
    from confluent_kafka import KafkaException, Producer

    try:
        Producer(dict(make()._config)).flush(0)
    except KafkaException as error:
        return mask_text(error.args[0].str() if error.args else str(error))
    return None


def missing_secrets(config: PoliciesConfig) -> list[str]:
    """The secrets the file names an environment variable for (HMAC secrets, Kafka passwords) whose
    variable is not set here: the relay or the worker that needs one refuses to start without it."""
    import os

    named: list[tuple[str, str | None]] = []
    for name, dest in config.destinations.items():
        if isinstance(dest, KafkaDestination):
            named += [(f"destinations.{name}.sasl_password_env", dest.sasl_password_env)]
            named += [(f"destinations.{name}.ssl_key_password_env", dest.ssl_key_password_env)]
        elif isinstance(dest, HttpDestination):
            named += [(f"destinations.{name}.hmac_secret_env", dest.hmac_secret_env)]
    for consumer, policy in config.consumers.items():
        for type_, h in policy.handlers.items():
            if isinstance(h, HttpHandlerConfig):
                named += [(f"consumers.{consumer}.handlers.{type_}.hmac_secret_env", h.hmac_secret_env)]
    return [
        f"{where}: environment variable {env} is not set"
        for where, env in named
        if env and not os.environ.get(env)
    ]


def check_file_retention(config: PoliciesConfig) -> None:
    """:func:`check_retention` for what the file alone says (``config check``, without the
    handlers' code): the default retry policy and the file's, of every consumer and type."""
    policies = [RetryPolicy()]
    for consumer in config.consumers.values():
        policies += [consumer.retry_policy(t) for t in (None, *consumer.types)]
    _check_horizon(config, policies)


def _check_horizon(config: PoliciesConfig, policies: list[RetryPolicy]) -> None:
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
    from postbox.inbox.sql_handlers import sql_batch_function_handler, sql_function_handler
    from postbox.outbox.transports.http import OutboundPolicy

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
        if isinstance(h, SqlHandlerConfig) and h.batch:
            out.add(
                sql_batch_function_handler(h.function),  # type: ignore[arg-type]
                consumer,
                message_type,
                batch=True,
                idempotent=h.idempotent,
                timeout=h.timeout,
            )
        elif isinstance(h, SqlHandlerConfig):
            out.add(
                sql_function_handler(h.function),
                consumer,
                message_type,
                idempotent=h.idempotent,
                timeout=h.timeout,
                database_only=h.database_only,
            )
        else:
            secret = _secret(h.hmac_secret_env, where)
            endpoint = HttpEndpoint(
                h.url,
                timeout=h.timeout,
                secret=secret,
                headers=h.headers,
                max_concurrency=h.max_concurrency,
                outbound=OutboundPolicy(config.http_allowed_hosts, config.http_deny_private_networks),
            )
            out.add(endpoint, consumer, message_type, idempotent=h.idempotent, timeout=h.timeout + 5.0)
    return out


def sql_functions(config: PoliciesConfig, consumer: str) -> list[str]:
    """The SQL-function handlers declared for ``consumer`` (checked to exist at start-up)."""
    policy = config.consumers.get(consumer)
    if policy is None:
        return []
    return [h.function for h in policy.handlers.values() if isinstance(h, SqlHandlerConfig)]
