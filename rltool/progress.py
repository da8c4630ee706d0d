"""Progress of a long stage: a rich bar with rate and ETA when stderr is a terminal, a plain log
line every `interval_s` seconds otherwise (CI logs get a few lines, not a redrawn bar), and
nothing at all with `-q`.

`-q` reaches here through the logging setup (rltool/logs.py): the bar and the lines show only
while the `rltool.progress` logger passes INFO, so a stage needs no quiet flag of its own, and
under torchrun only rank 0 shows progress (the other ranks log warnings only). A finished bar is
cleared (the command's own summary line follows it), so a loop's step lines stay one per step.

    with Progress("train", total=plan.num_steps, unit="steps") as progress:
        for step in ...:
            ...
            progress.advance(1, info=f"loss {loss:.4g}")
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("rltool.progress")
DEFAULT_INTERVAL_S = 10.0


def enabled() -> bool:
    """Progress shows at all: its logger passes INFO (not under -q, not on a non-zero torchrun
    rank; a program that keeps other INFO lines off, like the demo, may set this logger alone
    to INFO)."""
    return log.isEnabledFor(logging.INFO)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """One counter towards `total` (None: unknown). Thread-safe: workers may advance it.

    `quiet` turns it off (a stage the loop runs in-process, whose step line says enough);
    `terminal` overrides the stderr-is-a-terminal test (the tests use it)."""

    def __init__(self, description: str, *, total: float | None, unit: str = "items",
                 quiet: bool = False, interval_s: float | None = None,
                 terminal: bool | None = None):
        self.description, self.total, self.unit = description, total, unit
        self.interval_s = DEFAULT_INTERVAL_S if interval_s is None else interval_s
        self.done = 0.0
        self.info = ""
        self._lock = threading.Lock()
        self.started = self._last_line = time.monotonic()
        self.lines = 0
        self.mode = "off"
        if enabled() and not quiet:
            is_tty = sys.stderr.isatty() if terminal is None else terminal
            self.mode = "bar" if is_tty else "lines"
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> "Progress":
        self.started = self._last_line = time.monotonic()
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TaskProgressColumn, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TaskProgressColumn(), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task(self.description, total=self.total, rate="",
                                            info="")
            self._bar.start()
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.lines and exc_type is None:  # a stage short enough to print no line prints none
            self._line(final=True)

    def advance(self, amount: float = 1, *, info: str | None = None) -> None:
        with self._lock:
            self.done += amount
            if info is not None:
                self.info = info
            if self._bar is not None:
                self._bar.update(self._task, advance=amount, rate=self.rate_text(),
                                 info=self.info)
            elif self.mode == "lines" and time.monotonic() - self._last_line >= self.interval_s:
                self._line()

    def track(self, items: Iterable[T]) -> Iterator[T]:
        """Yield each item and count it done when the caller comes back for the next one; the
        display ends with the loop (also when its body raises: the generator is closed)."""
        with self:
            for item in items:
                yield item
                self.advance(1)

    def note(self, info: str) -> None:
        """Text shown after the counts (the last loss, a throughput) from the next update on."""
        self.info = info

    def rate_text(self) -> str:
        elapsed = time.monotonic() - self.started
        return f"{self.done / elapsed:,.3g} {self.unit}/s" if elapsed > 0 and self.done else ""

    def _line(self, *, final: bool = False) -> None:
        self.lines += 1
        self._last_line = now = time.monotonic()
        elapsed = now - self.started
        if self.total:
            count = f"{self.done:,.0f}/{self.total:,.0f} {self.unit} ({self.done / self.total:.0%})"
        else:
            count = f"{self.done:,.0f} {self.unit}"
        parts = [count]
        if rate := self.rate_text():
            parts.append(rate)
        if final:
            parts.append(f"took {format_duration(elapsed)}")
        elif self.total and self.done:
            parts.append(f"eta {format_duration(elapsed * (self.total - self.done) / self.done)}")
        if self.info:
            parts.append(self.info)
        log.info("%s: %s", self.description, ", ".join(parts))
