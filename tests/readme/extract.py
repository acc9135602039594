"""The snippets of README.md and docs/*.md: fenced code blocks and the inline code spans that are
whole SQL statements or ``postbox``/``make`` commands; and the headings links may point at."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from tests.helpers import REPO

README = REPO / "README.md"

# --- extraction -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snippet:
    """A fenced block (``language`` from its info string) or an inline code span (``inline``)."""

    language: str
    text: str
    line: int  # 1-based line of the opening fence (or of the span)
    inline: bool = False
    source: str = "README.md"  # the file, relative to the repository

    @property
    def id(self) -> str:
        page = "" if self.source == "README.md" else f"{Path(self.source).stem}-"
        return f"{page}L{self.line}-{'inline-' if self.inline else ''}{self.language or 'none'}"


FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def fenced_blocks(text: str) -> list[Snippet]:
    """Every fenced code block (CommonMark fences of backticks or tildes, indented up to 3 spaces)."""
    blocks: list[Snippet] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if (
                closing
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            body.append(lines[j])
            j += 1
        else:
            raise AssertionError(f"line {i + 1}: code fence never closed")
        language = info.split()[0].lower() if info else ""
        blocks.append(Snippet(language, "\n".join(body) + "\n", i + 1))
        i = j + 1
    return blocks


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of everything outside fenced blocks."""
    inside: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if fence and inside is None:
            inside = fence["fence"]
        elif fence and inside and fence["fence"][0] == inside[0] and not fence["info"].strip():
            inside = None
        elif inside is None:
            yield number, line


SQL_START = re.compile(
    r"^(SELECT|WITH|SET|ALTER|GRANT|REVOKE|INSERT|UPDATE|DELETE|CREATE|DROP|EXPLAIN|CALL|VACUUM|TRUNCATE|DO)\s"
)
# An inline span with an ellipsis is a fragment of a statement (``SELECT … FOR UPDATE SKIP LOCKED``),
# quoted to name a technique, not a statement to run.
ELISION = ("…", "...")


def inline_snippets(text: str) -> list[Snippet]:
    """Inline code spans that are whole SQL statements or ``postbox``/``make`` commands."""
    spans = []
    for number, line in prose_lines(text):
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            if SQL_START.match(span) and not any(e in span for e in ELISION):
                spans.append(Snippet("sql", span, number, inline=True))
            elif re.match(r"^(postbox|make)(\s|$)", span):
                spans.append(Snippet("sh", span, number, inline=True))
    return spans


# The README and the manual in docs/: every page's snippets are checked the same way.
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [
    replace(b, source=str(page.relative_to(REPO)))
    for page in PAGES
    for b in fenced_blocks(page.read_text(encoding="utf-8"))
]
INLINE = [
    replace(s, source=str(page.relative_to(REPO)))
    for page in PAGES
    for s in inline_snippets(page.read_text(encoding="utf-8"))
]


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them."""
    found = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading[1].strip().lower().replace("`", ""))
            found.add(text.replace(" ", "-"))
    return found
