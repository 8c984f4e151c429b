"""A model's tokenizer loaded in a helper process, for one-shot commands.

`tokenizers` takes most of a second to read a large vocabulary and merge list (Gemma's
tokenizer.json), and holds the GIL throughout, so a thread cannot overlap it with torch's import. A
process forked before torch is imported loads it on the other core meanwhile; this process then asks
it to encode and decode over a pipe (two round trips per generated token, a small cost beside a
decode step: docs/benchmarks.md). vLLM keeps
its tokenizer apart from its engine core the same way. The helper ends when this process closes the
pipe or exits, killed included.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import threading
from pathlib import Path

from larqlpy.errors import LarqlError
from larqlpy.model.families import read_config
from larqlpy.text.tokenizer import Tokenizer


def _serve(conn, parents_end, path: str) -> None:  # pragma: no cover - runs in the helper process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    parents_end.close()  # else the pipe never reads EOF when the parent dies
    try:
        p = Path(path)
        tok = Tokenizer.from_dir(p, read_config(p))
    except LarqlError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ok", (tok.bos_id, tok.add_bos, tok.stop_ids, tok.fingerprint, tok.config, tok.vocab_size)))
    calls = {"ids_of": tok.ids_of, "decode": tok.decode, "token_bytes": tok.token_bytes, "to_json": tok.to_json}
    while True:
        try:
            name, arg = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(calls[name](arg))


class RemoteTokenizer(Tokenizer):
    """A Tokenizer whose vocabulary lives in the helper: the same answers, asked over the pipe."""

    def __init__(self, conn, meta: tuple):
        bos_id, add_bos, stop_ids, fingerprint, config, self._vocab_size = meta
        super().__init__(None, bos_id, add_bos, stop_ids, fingerprint, config)
        self.conn = conn

    def _ask(self, name: str, arg):
        try:
            self.conn.send((name, arg))
            return self.conn.recv()
        except (EOFError, OSError):
            raise LarqlError("the tokenizer's helper process ended unexpectedly") from None

    def ids_of(self, text: str) -> list[int]:
        return self._ask("ids_of", text)

    def decode(self, ids: list[int]) -> str:
        return self._ask("decode", list(ids))

    def token_bytes(self, tok: int) -> bytes:
        return self._ask("token_bytes", tok)

    def to_json(self, _=None) -> str:
        return self._ask("to_json", None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def close(self) -> None:
        self.conn.close()


class TokenizerProcess:
    """The helper, started; `tokenizer()` waits for it to finish loading."""

    def __init__(self, path: Path):
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        for stream in (sys.stdout, sys.stderr):  # the child must not write our buffered output again
            stream.flush()
        self.process = ctx.Process(target=_serve, args=(child, self.conn, str(path)), daemon=True,
                                   name="larqlpy-tokenizer")
        self.process.start()
        child.close()

    def tokenizer(self) -> Tokenizer:
        """The loaded tokenizer, or the LarqlError that loading it raised (tokenizer.json missing, unreadable)."""
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            raise LarqlError("the tokenizer's helper process ended before loading the tokenizer") from None
        if status == "error":
            self.conn.close()
            raise LarqlError(value)
        return RemoteTokenizer(self.conn, value)


def start(path: str | Path) -> TokenizerProcess | None:
    """Start loading `path`'s tokenizer in a helper process, if that can gain anything: None (the
    caller loads it in-process) once torch is imported -- nothing left to overlap, and forking a process
    that runs threads is unsafe -- or where this platform cannot fork."""
    if "torch" in sys.modules or threading.active_count() > 1 or "fork" not in mp.get_all_start_methods():
        return None
    return TokenizerProcess(Path(path))
