"""The retry tables of a configuration (``retry`` of a consumer, of its types, of a destination):
each must make a valid retry policy, a type's merged over its consumer's. Checked after the rest of
the settings, and from the file as written when the rest is wrong, so that one run names every
problem."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from postbox.config.policy_models import ConsumerPolicy
from postbox.errors import ConfigError
from postbox.failures.policy import RetryPolicy

__all__ = ["check_retry_tables", "document_retry_problems"]


def check_retry_tables(consumers: Mapping[str, ConsumerPolicy], destinations: Mapping[str, Any]) -> None:
    """Every retry table of the policies makes a valid retry policy (each problem named by its path)."""
    tables = [
        (f"consumers.{name}." + (f"types.{type_}." if type_ else "") + "retry.", consumer.retry, type_retry)
        for name, consumer in consumers.items()
        for type_, type_retry in ((None, None), *((t, p.retry) for t, p in consumer.types.items()))
    ]
    tables += [(f"destinations.{name}.retry.", dest.retry, None) for name, dest in destinations.items()]
    problems = _retry_table_problems(tables)
    if problems:
        raise ConfigError(f"invalid configuration: {'; '.join(problems)}")


def document_retry_problems(document: dict[str, Any] | None) -> list[str]:
    """The problems of the retry tables of a file as written (its other problems aside)."""
    tables: list[tuple[str, Any, Any]] = []
    for section in ("consumers", "destinations"):
        entries = (document or {}).get(section)
        for name, entry in (entries if isinstance(entries, dict) else {}).items():
            if not isinstance(entry, dict):
                continue
            tables.append((f"{section}.{name}.retry.", entry.get("retry") or {}, None))
            types = entry.get("types") if section == "consumers" else None
            for type_, policy in (types if isinstance(types, dict) else {}).items():
                if isinstance(policy, dict) and policy.get("retry"):
                    tables.append(
                        (f"{section}.{name}.types.{type_}.retry.", entry.get("retry") or {}, policy["retry"])
                    )
    return _retry_table_problems(tables)


def _retry_table_problems(tables: list[tuple[str, Any, Any]]) -> list[str]:
    """``(where, retry table, a type's table over it or None)``: what is wrong with each merged."""
    problems = []
    failed: set[str] = set()  # consumers whose own table is wrong: their types' would say it again
    for where, base, over in tables:
        owner = where.split(".types.")[0].removesuffix("retry.").rstrip(".")
        if not isinstance(base, dict) or not isinstance(over, dict | None) or owner in failed:
            continue  # not a table (the model's validation names it), or said already
        try:
            RetryPolicy(**{**base, **(over or {})})
        except ValidationError as error:
            problems.append(_retry_problems(error, where))
            if over is None:
                failed.add(owner)
    return problems


def _retry_problems(error: ValidationError, prefix: str) -> str:
    return "; ".join(
        f"{prefix}{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
        for e in error.errors()
    )
