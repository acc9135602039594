"""One SQL source for the inbox and the outbox: SQL templates rendered per direction.

The inbox and the outbox run the same queue protocol (claim, lease, attempt fence, retry, release,
dead letter, next head) on two tables. Each shared piece is written once, in a template, and
rendered for each direction when a migration applies it. A template is plain SQL with three marks:

- ``{{name}}``: a word of the direction, from :data:`DIRECTIONS` (``{{table}}``, ``{{queue}}``, ...);
- ``{{#inbox}}...{{/inbox}}`` (or ``outbox``): text that only that direction has;
- ``{{#each}}...{{/each}}``: text repeated once per direction (inbox, then outbox), inside SQL that
  is written once, e.g. the two branches of a function that serves both tables.

A mark alone on its line takes its line with it. Rendering is a pure function of the text (the
same template always gives the same SQL), so migrations that apply templates stay reproducible.
"""

from __future__ import annotations

import re

__all__ = ["DIRECTIONS", "expand", "expand_if_template", "render", "render_each"]

# The words that differ between the two directions; templates name them as {{word}}.
DIRECTIONS: dict[str, dict[str, str]] = {
    "inbox": {
        "table": "inbox",
        "queue": "consumer",  # the column naming the queue a row is in
        "lock": "1",  # the class of postbox.try_lock_key_v1 for its keys
        "agent": "worker",  # what claims rows
        "Agent": "Worker",
        "item": "message",
        "done": "processed",  # what the agent does with a row
        "redone": "delivered",  # what an attempt after a lost lease does
        "channel": "postbox_inbox",  # LISTEN/NOTIFY channel that wakes the agents
    },
    "outbox": {
        "table": "outbox",
        "queue": "destination",
        "lock": "2",
        "agent": "relay",
        "Agent": "Relay",
        "item": "row",
        "done": "published",
        "redone": "published",
        "channel": "postbox_outbox",
    },
}

_NAMES = "|".join(DIRECTIONS)
_EACH = re.compile(r"^\{\{#each\}\}\n(.*?)^\{\{/each\}\}\n|\{\{#each\}\}(.*?)\{\{/each\}\}", re.M | re.S)
_ONLY = re.compile(
    rf"^\{{\{{#({_NAMES})\}}\}}\n(.*?)^\{{\{{/\1\}}\}}\n|\{{\{{#({_NAMES})\}}\}}(.*?)\{{\{{/\3\}}\}}",
    re.M | re.S,
)
_WORD = re.compile(r"\{\{(\w+)\}\}")


def render(template: str, direction: str) -> str:
    """``template`` for one direction: its blocks kept or dropped, its words filled in."""
    words = DIRECTIONS[direction]

    def only(m: re.Match[str]) -> str:
        name, body = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return body if name == direction else ""

    def word(m: re.Match[str]) -> str:
        if m.group(1) not in words:
            raise ValueError(f"postbox: unknown template word {{{{{m.group(1)}}}}}")
        return words[m.group(1)]

    return _check(_WORD.sub(word, _ONLY.sub(only, template)))


def render_each(template: str) -> str:
    """``template`` with each ``{{#each}}`` block repeated for every direction; nothing else may vary."""

    def each(m: re.Match[str]) -> str:
        body = m.group(1) if m.group(1) is not None else m.group(2)
        return "".join(render(body, direction) for direction in DIRECTIONS)

    return _check(_EACH.sub(each, template))


def expand(template: str) -> str:
    """A template that is the same for both directions, rendered once per direction, inbox first."""
    return "\n".join(render(template, direction) for direction in DIRECTIONS)


_MARK = re.compile(r"\{\{[#/]?\w+\}\}")


def expand_if_template(text: str) -> str:
    """``text`` as it is, or, if it holds template marks, :func:`expand`-ed (named query files)."""
    return expand(text) if _MARK.search(text) else text


def _check(sql: str) -> str:
    left = _MARK.search(sql)
    if left:
        raise ValueError(f"postbox: a template mark was left unrendered: {left.group(0)!r}")
    return sql
