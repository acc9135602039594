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
    consumer's and destination's, and each type's merged over its consumer's. Where the consumer's
    own table is wrong, that is said once, and of its types' tables only what their own settings
    get wrong is said (merged over the rest of the consumer's)."""
    problems: list[str] = []
    for section in ("consumers", "destinations"):
        entries = (document or {}).get(section)
        for name, entry in (entries if isinstance(entries, dict) else {}).items():
            base = entry.get("retry") or {} if isinstance(entry, dict) else None
            if not isinstance(base, dict):
                continue  # not a table: the model's validation names it
            errors = _errors(base)
            problems += _said(f"{section}.{name}.retry", errors)
            base = {k: v for k, v in base.items() if k not in {str(e["loc"][0]) for e in errors if e["loc"]}}
            types = entry.get("types") if section == "consumers" else None
            for type_, policy in (types if isinstance(types, dict) else {}).items():
                over = policy.get("retry") if isinstance(policy, dict) else None
                if isinstance(over, dict) and over:
                    found = _errors({**base, **over})
                    if errors:  # the consumer's own problems are said: only the type's settings' here
                        found = [e for e in found if e["loc"] and str(e["loc"][0]) in over]
                    problems += _said(f"{section}.{name}.types.{type_}.retry", found)
    return problems


def _errors(table: dict[str, Any]) -> list[Any]:
    """What is wrong with ``table`` as a retry policy: pydantic's errors, located by setting (none
    for a problem of the table as a whole)."""
    try:
        RetryPolicy(**table)
    except ValidationError as error:
        return list(error.errors())
    return []


def _said(where: str, errors: list[Any]) -> list[str]:
    """``errors`` as one problem named under ``where`` (none if there are none)."""
    if not errors:
        return []
    return [
        "; ".join(
            f"{'.'.join([where, *(str(p) for p in e['loc'])])}: {e['msg'].removeprefix('Value error, ')}"
            for e in errors
        )
    ]
