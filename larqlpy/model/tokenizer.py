"""Text <-> token ids through the `tokenizers` library, BOS as tokenizer_config.json says."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from larqlpy.errors import LarqlError


class Tokenizer:
    def __init__(self, inner: HFTokenizer, bos_id: int, add_bos: bool, stop_ids: set[int], fingerprint: str):
        self.inner, self.bos_id, self.stop_ids, self.fingerprint = inner, bos_id, stop_ids, fingerprint
        self.add_bos = add_bos  # tokenizer_config.json's add_bos_token (Gemma: true)

    @classmethod
    def from_dir(cls, path: Path, cfg) -> "Tokenizer":
        tok_path = path / "tokenizer.json"
        if not tok_path.is_file():
            raise LarqlError(f"{path}: no tokenizer.json")
        raw = tok_path.read_bytes()
        try:
            inner = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:
            raise LarqlError(f"{tok_path}: not a readable tokenizer ({str(e).splitlines()[0]})") from None
        tcfg = {}
        tcfg_path = path / "tokenizer_config.json"
        if tcfg_path.is_file():
            try:
                tcfg = json.loads(tcfg_path.read_text())
            except json.JSONDecodeError as e:
                raise LarqlError(f"{tcfg_path}: not valid JSON ({e})") from None
        add_bos = bool(tcfg.get("add_bos_token", True))
        # The tokenizer.json may already add BOS in its post-processor: never add it twice.
        stop = set(cfg.eos_token_ids)
        turn_end = inner.token_to_id("<end_of_turn>")
        if turn_end is not None:
            stop.add(turn_end)
        return cls(inner, cfg.bos_token_id, add_bos, stop, hashlib.sha256(raw).hexdigest()[:16])

    def encode(self, text: str) -> list[int]:
        # BOS is added here rather than by tokenizer.json's post-processor, so a prompt that already
        # starts with "<bos>" never gets it twice.
        ids = self.inner.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=True)

    def stream(self) -> "Detokenizer":
        """An incremental decoder for generated ids (special tokens skipped, as `decode` does)."""
        return Detokenizer(self.decode)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size()


class Detokenizer:
    """Text of generated ids, one id at a time, at a cost per id that does not grow with the output.

    It decodes only a short window: the ids since the last emitted text (`read`), with the id before
    them for context (`prefix`); the new text is what that window adds to its context. While the
    window ends inside a UTF-8 character (a trailing U+FFFD) it waits -- at most WAIT ids, the
    longest a character can take, after which the bytes are not UTF-8 and come out as U+FFFD.
    (`tokenizers`' DecodeStream does the same but raises on such bytes, which a model can emit.)"""

    WAIT = 4

    def __init__(self, decode):
        self.decode = decode
        self.ids: list[int] = []  # from the context id on
        self.read = 0  # ids[:read] are already emitted text

    def step(self, token_id: int) -> str:
        """The new text this id completes ("" while a character is still open)."""
        self.ids.append(token_id)
        context = self.decode(self.ids[:self.read])
        text = self.decode(self.ids)
        if (len(text) <= len(context) or text.endswith("\ufffd")) and len(self.ids) - self.read < self.WAIT:
            return ""
        new = text[len(context):]
        self.ids = self.ids[self.read:]  # the window just emitted becomes the next context
        self.read = len(self.ids)
        return new
