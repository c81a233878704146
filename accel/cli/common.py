"""Shared CLI plumbing: stderr console, --json output, rich progress bars, the 'not available yet' exit."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, ClassVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBar

from accel.errors import AccelError
from accel.progress import Progress


class OutputClosed(Exception):
    """Whoever read stdout stopped (`accel inspect OUT | head`). Not an OSError: click would turn that into exit 1,
    which here means "a check failed"; the CLI's main exits as a tool that SIGPIPE stopped (141), quietly."""


class _Console(Console):
    def on_broken_pipe(self) -> None:  # rich's default exits 1
        raise OutputClosed()


def write_stdout(text: str) -> None:
    """Write and flush stdout verbatim (not through rich, which drops control characters)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise OutputClosed() from None


# Text from the user (paths, model names, specs such as damp:abc) is printed as it is: no emoji codes (":abc:"
# would become an emoji) and no markup unless a call asks for it (markup=True with escaped values)
stderr = _Console(stderr=True, highlight=False, emoji=False, markup=False)


def _piped_width() -> int | None:
    """None (rich asks the terminal) when stdout is a terminal or COLUMNS is set; otherwise a width no line reaches.

    Piped or captured, rich would lay tables out in 80 columns and cut tensor names and paths to "model.la…"; the
    tables are not expanded, so each is as wide as its longest cells, and text lines are not broken."""
    return None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 10_000


stdout = _Console(highlight=False, emoji=False, markup=False, width=_piped_width())

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON object on stdout (logs and progress go to stderr).")


def print_warnings(lines: list[str]) -> None:
    """A report's `warnings`, one line each on stderr (in --json mode too: they are in the JSON as well)."""
    for line in lines:
        stderr.print(f"warning: {line}", soft_wrap=True)


def emit_json(obj: dict[str, Any]) -> None:
    """One JSON object on stdout; NaN and infinities (which json.dumps would write as bare NaN, not JSON) as null."""
    write_stdout(json.dumps(_finite(obj), sort_keys=True, default=_jsonable, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return _finite(value.item())
    return value


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return str(value)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that what is half written is removed on the way out."""


# set by the CLI's SIGTERM handler. The handler raises Terminated where the main thread is, and Python drops an
# exception raised inside a finalizer (__del__) with a note on stderr, so the progress calls raise it again
SIGTERM_SEEN = {"seen": False}


def _raise_if_terminated() -> None:
    if SIGTERM_SEEN["seen"]:
        raise Terminated()


def stderr_animates() -> bool:
    """Whether a progress bar may redraw itself on stderr: stderr is a terminal that can move its cursor. Asked of
    the file descriptor, not of rich, which takes FORCE_COLOR (or TTY_COMPATIBLE) as a terminal and would then
    redraw the bar into a CI log with carriage returns and cursor codes; TERM=dumb cannot move the cursor."""
    try:
        tty = os.isatty(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # a test's capture, a closed stream
        tty = False
    return tty and os.environ.get("TERM", "") != "dumb"


class BarProgress(Progress):
    """Rich progress bars on stderr, one per stage. Where a bar cannot redraw itself (a CI log, a pipe, a dumb
    terminal) it would be noise: a stage that took at least `LOG_AFTER` seconds writes one line when it ends instead.
    An interrupt or an error ends the command with a bar still drawn: the CLI's main calls `stop_all` first, which
    takes it off the screen and shows the cursor again, before it prints why the command stopped."""

    LOG_AFTER = 2.0
    _live: ClassVar[set[BarProgress]] = set()

    def __init__(self) -> None:
        self._bar: RichBar | None = None
        self._task = None
        self._stage: tuple[str, int, float] | None = None  # description, total, start (not a terminal)
        self._done = 0

    def stage(self, description: str, total: int) -> None:
        _raise_if_terminated()
        self.close()
        if not stderr_animates():
            self._stage, self._done = (description, total, time.perf_counter()), 0
            return
        self._bar = RichBar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=stderr, transient=True)
        self._bar.start()
        BarProgress._live.add(self)
        self._task = self._bar.add_task(description, total=total)

    @classmethod
    def stop_all(cls) -> None:
        """Stop every bar still drawn, without the log line of an unfinished stage (a command that stopped early)."""
        for progress in list(cls._live):
            progress._stage = None
            progress.close()

    def advance(self, steps: int = 1) -> None:
        _raise_if_terminated()
        self._done += steps
        if self._bar is not None:
            self._bar.advance(self._task, steps)

    def close(self) -> None:
        if self._bar is not None:
            BarProgress._live.discard(self)
            self._bar.stop()
            self._bar = None
        if self._stage is not None:
            description, total, start = self._stage
            seconds = time.perf_counter() - start
            if seconds >= self.LOG_AFTER:
                stderr.print(f"{description}: {self._done}/{total} in {seconds:.1f} s")
            self._stage = None


def not_available(what: str, issue: int) -> None:
    raise AccelError(f"{what} is not available yet (tracked in issue #{issue})")
