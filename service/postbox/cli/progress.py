"""Progress bars for the commands that take a while (``dlq replay`` in the foreground, ``replay
status --watch``, ``migrate``, ``maintain --once``): a rich bar on stderr when stderr is a
terminal, nothing at all otherwise (a pipe or a log file gets only what the command prints anyway).

Log lines written while a bar is shown go above it, not through it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from postbox.cli.output import terminal

__all__ = ["Bar", "alembic_steps", "progress_bar"]


class Bar:
    """One task of a progress display; every method does nothing when there is no terminal."""

    def __init__(self, progress: Progress | None = None, task: TaskID | None = None) -> None:
        self._progress = progress
        self._task = task

    @property
    def live(self) -> bool:
        """Whether a bar is shown (the caller may skip work only the bar needs)."""
        return self._progress is not None

    def update(self, **fields: Any) -> None:
        """``completed``, ``total``, ``advance``, ``description``, or ``detail`` (the text after the bar)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, **fields)

    def advance(self, steps: float = 1) -> None:
        self.update(advance=steps)


@contextmanager
def progress_bar(description: str, total: float | None = None, enabled: bool = True) -> Iterator[Bar]:
    """A progress bar on stderr while the block runs, if stderr is a terminal (and ``enabled``)."""
    console = terminal(stderr=True) if enabled else None
    if console is None:
        yield Bar()
        return
    original = sys.stderr
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}", markup=False),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        task = progress.add_task(description, total=total, detail="")
        with _logs_above(original):
            yield Bar(progress, task)


@contextmanager
def _logs_above(original: Any) -> Iterator[None]:
    """Point the log handlers that write to the real stderr at the live display's stand-in (rich
    prints what it gets above the bar), and back afterwards."""
    moved = [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and h.stream is original and sys.stderr is not original
    ]
    for handler in moved:
        handler.setStream(sys.stderr)
    try:
        yield
    finally:
        for handler in moved:
            handler.setStream(original)


class _Counter(logging.Handler):
    def __init__(self, bar: Bar) -> None:
        super().__init__(logging.INFO)
        self.bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Running upgrade"):
            self.bar.advance()


@contextmanager
def alembic_steps(bar: Bar) -> Iterator[None]:
    """Advance ``bar`` by one for each revision Alembic applies (it says so on its own logger,
    which is kept from the postbox log meanwhile)."""
    if not bar.live:
        yield
        return
    logger = logging.getLogger("alembic.runtime.migration")
    counter = _Counter(bar)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(counter)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(counter)
        logger.setLevel(level)
        logger.propagate = propagate
