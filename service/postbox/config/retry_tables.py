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
    problems = document_retry_problems(
        {
            "consumers": {name: c.model_dump(include={"retry", "types"}) for name, c in consumers.items()},
            "destinations": {name: d.model_dump(include={"retry"}) for name, d in destinations.items()},
        }
    )
    if problems:
        raise ConfigError(f"invalid configuration: {'; '.join(problems)}")


def document_retry_problems(document: dict[str, Any] | None) -> list[str]:
    """The problems of the retry tables of a file as written (its other problems aside): each
    consumer's and destination's, and each type's merged over its consumer's (unless the consumer's
    own is wrong: that is said once)."""
    problems: list[str] = []
    for section in ("consumers", "destinations"):
        entries = (document or {}).get(section)
        for name, entry in (entries if isinstance(entries, dict) else {}).items():
            base = entry.get("retry") or {} if isinstance(entry, dict) else None
            if not isinstance(base, dict):
                continue  # not a table: the model's validation names it
            problem = _problem(f"{section}.{name}.retry.", base)
            if problem is not None:
                problems.append(problem)
                continue
            types = entry.get("types") if section == "consumers" else None
            for type_, policy in (types if isinstance(types, dict) else {}).items():
                over = policy.get("retry") if isinstance(policy, dict) else None
                if isinstance(over, dict) and over:
                    problem = _problem(f"{section}.{name}.types.{type_}.retry.", {**base, **over})
                    problems += [problem] if problem is not None else []
    return problems


def _problem(where: str, table: dict[str, Any]) -> str | None:
    """What is wrong with ``table`` as a retry policy, each problem named under ``where``."""
    try:
        RetryPolicy(**table)
    except ValidationError as error:
        return "; ".join(
            f"{where}{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
            for e in error.errors()
        )
    return None
