"""Bounds on rendering a chat template. A model's template is code from its repository, and jinja's
sandbox caps `range()` only, so a template could loop for ever or build a string of any size. Here:

- time: `within` runs the render under a deadline; past it, a watchdog thread raises an exception
  in the rendering thread (PyThreadState_SetAsyncExc), which Python code anywhere in the render,
  the template's or a filter's, meets at its next instruction. A sys.settrace tracer would do the
  same in the thread itself, but its calls made a normal render three to four times slower (the
  watchdog: 2 µs on 30-50; bench/template_bounds.py). Neither stops what C runs in one step (a
  power, a repetition, a padding), so that is refused before it runs:
- size: no string, list or output a template makes may pass `Bounds.chars`; each operation's
  result is estimated from its operands first (template_rules.py), `text_size` estimating what
  str() makes of a structure, a list shared by reference counted each time str() would write it.
  Every list, tuple or dict is measured as it is made, so no value can print (or compare, which C
  does item by item where no deadline reaches) past the limit, however it was doubled;
- integers from `**` and `*`: at most `Bounds.int_bits` bits.

Going past one is a `TemplateBoundError`, a LarqlError callers can tell apart from the template's
own `raise_exception`.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from jinja2.utils import Namespace

from larqlpy.errors import LarqlError


class TemplateBoundError(LarqlError):
    """A chat template went past a bound of rendering (time, size): not its own refusal."""


@dataclass(frozen=True)
class Bounds:
    seconds: float = 1.0  # wall-clock time of one render
    chars: int = 16 * 2**20  # any string, list or output a template makes (characters, items)
    int_bits: int = 65536  # integers made by ** and *


BOUNDS = Bounds()
_clock = time.monotonic


class _Expired(BaseException):
    """The deadline passed. A BaseException: jinja's runtime catches Exception in places."""


def _raise_in(thread: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in `thread` at its next instruction (None: take back one not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc) if exc else None)


class _Watchdog:
    """One daemon thread for every rendering thread: it sleeps till the earliest deadline and raises
    _Expired in each thread whose deadline has passed. Once a thread is watched that exception may
    land at any of its instructions, so from then on it touches only what C implements: a Lock
    (which `with` lets go of wherever it lands) and a SimpleQueue to wake the watchdog. A
    Condition's or an Event's Python-level acquire could be left holding its lock for ever."""

    def __init__(self):
        self.due: dict[int, float] = {}  # rendering thread -> its deadline
        self.fired: set[int] = set()  # threads raised in, their render not yet released
        self.lock = threading.Lock()
        self.wake: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def watch(self, thread: int, end: float) -> None:
        if self.thread is None or not self.thread.is_alive():  # the first render, or a forked child's
            with self.lock:
                if self.thread is None or not self.thread.is_alive():
                    self.thread = threading.Thread(target=self._run, name="larqlpy-template-deadline", daemon=True)
                    self.thread.start()
        with self.lock:
            self.fired.discard(thread)
            idle = not self.due
            self.due[thread] = end
        if idle:  # else it wakes for an earlier deadline anyway
            self.wake.put(None)

    def release(self, thread: int) -> None:
        """The render in `thread` is over: an _Expired raised too late to have landed is taken back."""
        with self.lock:
            self.due.pop(thread, None)
            late = thread in self.fired
            self.fired.discard(thread)
        if late:
            _raise_in(thread, None)

    def _run(self) -> None:
        while True:
            with self.lock:
                now = _clock()
                for thread in [t for t, end in self.due.items() if end <= now]:
                    del self.due[thread]
                    self.fired.add(thread)
                    _raise_in(thread, _Expired)
                sleep = min(self.due.values()) - now if self.due else None
            try:
                self.wake.get(timeout=sleep)
            except queue.Empty:
                pass


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=lambda: _WATCHDOG.__init__())  # its lock and thread stay with the parent


def within(seconds: float, render: Callable[..., Any], *args: Any) -> Any:
    """`render(*args)`, stopped with a TemplateBoundError once it has run `seconds`."""
    thread = threading.get_ident()
    try:
        _WATCHDOG.watch(thread, _clock() + seconds)
        try:
            return render(*args)
        finally:
            _WATCHDOG.release(thread)
    except _Expired:
        pass
    raise TemplateBoundError(f"rendering took more than {seconds:g} s (a loop without end?)")


def refuse_size(what: str, size: int, b: Bounds) -> None:
    if size > b.chars:
        raise TemplateBoundError(f"{what} would make {size:,} characters or items (the limit is {b.chars:,})")


def refuse_bits(what: str, bits: int, b: Bounds) -> None:
    if bits > b.int_bits:
        raise TemplateBoundError(f"{what} would make an integer of about {bits:,} bits (the limit is {b.int_bits:,})")


def text_size(value: Any) -> int:
    """About how many characters str(value) makes (an upper bound for what the template holds)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (int, float)) or value is None:
        return _leaf(value)
    return measure(value)[0]


_LEAVES = {bool: 5, float: 24, type(None): 4}
_OTHER = 64  # the repr of an object of jinja's runtime (a loop, a macro, a cycler)


def _leaf(x: Any) -> int:
    size = _LEAVES.get(type(x))
    if size is not None:
        return size
    if isinstance(x, str):  # as repr() writes it inside a structure: quoted, escaped where unprintable
        return len(x) + 2 if x.isprintable() else 4 * len(x) + 2
    if isinstance(x, int):
        return abs(x).bit_length() * 10 // 33 + 2
    if isinstance(x, (bytes, bytearray)):
        return 4 * len(x) + 3
    return _OTHER


def _items(x: Any) -> list | None:
    """What str() of a structure writes inside it, or None for a leaf."""
    if isinstance(x, (list, tuple, set, frozenset)):
        return list(x)
    if isinstance(x, dict):
        return [part for item in x.items() for part in item]
    if isinstance(x, Namespace):  # written as <Namespace {...}>
        return [object.__getattribute__(x, "_Namespace__attrs")]
    if type(x).__name__ in ("dict_keys", "dict_values", "dict_items"):
        return list(x)
    return None


def measure(root: Any) -> tuple[int, int, int]:
    """(characters, items, depth) of str(root), each shared item counted as often as it is written.
    Walked once per distinct item, so a structure built by doubling costs what was built, not what
    it would print; a cycle counts as repr's '[...]'."""
    memo: dict[int, tuple[int, int, int]] = {}
    held = []  # what was walked, alive till the end: an id is a key only while its object lives
    stack: list[tuple[Any, list | None, list[int] | None]] = [(root, None, None)]
    while stack:
        x, items, counts = stack.pop()
        if items is not None:  # its items are measured: add them up, each as often as it is there
            size, count, depth = 2 + 2 * sum(counts), 1, 0
            for i, n in zip(items, counts):
                s, c, d = memo[id(i)]
                size, count, depth = size + n * s, count + n * c, max(depth, d)
            memo[id(x)] = (size, count, depth + 1)
            continue
        if id(x) in memo:
            continue
        items = _items(x)
        if items is None:
            memo[id(x)] = (_leaf(x), 1, 0)
            continue
        memo[id(x)] = (5, 1, 0)  # while its items are walked
        if len(items) > 64:  # counted in C, each distinct item walked once: [x] * 10**6 is one x
            counts = list(Counter(map(id, items)).values())
            items = list(dict(zip(map(id, items), items)).values())  # in first-seen order, as Counter's
        else:
            counts = [1] * len(items)
        held.append(items)
        stack.append((x, items, counts))
        stack.extend((i, None, None) for i in items if id(i) not in memo)
    return memo[id(root)]
