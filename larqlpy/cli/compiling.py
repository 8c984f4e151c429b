"""The progress line while numba compiles kernels for this CPU (kernels/compiles.py hears them).

A fresh numba cache makes the first run compile a dozen kernels (a minute on 2 cores) before and
while it answers; this says so on stderr the moment the first compile starts, and nothing at all on a
warm run (no compile, no event). On a terminal it is a live status; elsewhere (pipes, tests, the
server's log) plain lines, one as compiling starts and one per kernel compiled. The answer streams
to stdout: the live status stops for good once it begins on the same terminal, as a status redrawn
under a half-written line would overwrite it.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console

from larqlpy.cli.common import err

ONCE = "once: later runs load them from numba's cache"


class CompileProgress:
    def __init__(self, console: Console, live: bool, shares_screen: bool):
        """`live`: a rich status (a terminal); `shares_screen`: the answer goes to the same terminal."""
        self.console, self.live, self.shares_screen = console, live, shares_screen
        self.lock = threading.Lock()
        self.status = None
        self.count, self.seconds = 0, 0.0  # compiled while this shows (the process may have compiled before)
        self.reported = 0  # kernels counted in a summary line already
        self.answering = False
        self.announced = False  # plain lines: the first compile since the last summary said so

    def __call__(self, p) -> None:  # a kernels.compiles.Progress
        with self.lock:
            if p.seconds is not None:
                self.count += 1
                self.seconds += p.seconds
            if self.live and not (self.answering and self.shares_screen):
                self._show(p)
            elif not self.live:
                if not self.announced:  # a measured choice has no start of its own
                    self.announced = True
                    self._line(f"compiling kernels for this CPU ({ONCE})")
                if p.seconds is not None:
                    self._line(f"compiled {self.count}: {p.kernel} ({p.seconds:.1f} s)")

    def _show(self, p) -> None:
        doing = f"{p.kernel} ..." if p.seconds is None else f"{p.kernel} ({p.seconds:.1f} s)"
        text = f"compiling kernels for this CPU ({ONCE}): {self.count} done, {doing}"
        if self.status is None:
            self.status = self.console.status(text, spinner="dots")
            self.status.start()
        else:
            self.status.update(text)

    def _line(self, text: str) -> None:
        self.console.print(f"larqlpy: {text}", markup=False, soft_wrap=True, highlight=False)

    def _stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def pause(self) -> None:
        """The answer is about to be written to stdout: no live status over it from here."""
        if self.answering:
            return
        with self.lock:
            self.answering = True
            if self.status is not None and self.shares_screen:
                self._stop()
                self._summary("so far")

    def done(self) -> None:
        """An answer has ended: the compiles since the last summary, in one line."""
        with self.lock:
            self._stop()
            self._summary()
            self.answering = self.announced = False

    def _summary(self, tail: str = "") -> None:
        if self.count > self.reported:
            kernels = f"{self.count} kernel{'s' if self.count > 1 else ''}"
            self._line(f"compiled {kernels} for this CPU in {self.seconds:.1f} s{' ' + tail if tail else ''} ({ONCE})")
            self.reported = self.count


@contextmanager
def compile_progress(console: Console = err, live: bool | None = None) -> Iterator[CompileProgress]:
    """Show kernel compiles while the block runs; `live`: a rich status (default: on a terminal)."""
    from larqlpy.kernels.compiles import announce, begin_ahead, looks_cold, on_progress

    live = console.is_terminal if live is None else live
    printer = CompileProgress(console, live, live and sys.stdout.isatty())
    if os.environ.get("LARQLPY_COMPILE_PROGRESS") == "0":  # a log that must hold only its command's own lines
        yield printer
        return
    with on_progress(printer):
        if looks_cold():  # said now, not after the model's header is read and torch imported (seconds)
            announce("kernels for this CPU")
            begin_ahead()  # a helper process imports and compiles meanwhile (kernels/ahead.py)
        try:
            yield printer
        finally:
            printer.done()
