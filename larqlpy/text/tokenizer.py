"""Text <-> token ids through the `tokenizers` library: BOS as tokenizer_config.json says (or, without
the key, as tokenizer.json's post-processor does), the special tokens the chat template names, and
the ids that end a turn."""

from __future__ import annotations

import hashlib
import json
import re
from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from larqlpy.errors import LarqlError
from larqlpy.text.tool_formats import MARKERS


# The tokens that end a turn in the chat templates of the supported families (a run stops at them as
# at EOS): Gemma, ChatML (Qwen, SmolLM), Llama 3, and Phi-style.
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(self, inner: HFTokenizer, bos_id: int | None, add_bos: bool, stop_ids: set[int], fingerprint: str,
                 config: dict | None = None):
        self.inner, self.bos_id, self.stop_ids, self.fingerprint = inner, bos_id, stop_ids, fingerprint
        self.add_bos = add_bos and bos_id is not None  # Gemma, Llama: yes; Qwen, SmolLM2: no
        self.config = config or {}  # tokenizer_config.json: special tokens, the chat template

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as text, for chat templates (as transformers passes them)."""
        out = {}
        for name in SPECIAL_NAMES:
            value = self.config.get(name)
            if isinstance(value, dict):  # the AddedToken spelling
                value = value.get("content")
            if isinstance(value, str):
                out[name] = value
        return out

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
        template_file = path / "chat_template.jinja"  # newer HF directories keep the template beside
        if "chat_template" not in tcfg and template_file.is_file():
            tcfg["chat_template"] = template_file.read_text()
        bos = tcfg.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        bos_id = inner.token_to_id(bos) if isinstance(bos, str) else None
        bos_id = cfg.bos_token_id if bos_id is None else bos_id
        add_bos = tcfg["add_bos_token"] if "add_bos_token" in tcfg else _post_processor_adds(inner, bos_id)
        stop = set(cfg.eos_token_ids)
        for name in END_OF_TURN:
            if (i := inner.token_to_id(name)) is not None:
                stop.add(i)
        return cls(inner, bos_id, bool(add_bos), stop, hashlib.sha256(raw).hexdigest()[:16], tcfg)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Ids of `text`; BOS first when the model wants one (`add_bos`: override; a rendered chat
        template brings its own). BOS is added here rather than by tokenizer.json's post-processor, so
        a prompt that already starts with it never gets it twice."""
        ids = self.ids_of(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None and \
                (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def ids_of(self, text: str) -> list[int]:
        """tokenizer.json's ids of `text`, nothing added."""
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens skipped but the tool-call markers (Mistral's [TOOL_CALLS]
        is one): the reply's calls are read from its text."""
        if not self._markers.keys() & set(ids):
            return self.inner.decode(ids, skip_special_tokens=True)
        parts, start = [], 0
        for i, t in enumerate(ids):
            if t in self._markers:
                parts += [self.inner.decode(ids[start:i], skip_special_tokens=True), self._markers[t]]
                start = i + 1
        return "".join(parts) + self.inner.decode(ids[start:], skip_special_tokens=True)

    @cached_property
    def _markers(self) -> dict[int, str]:
        """The special tokens that are tool-call markers (text/tool_formats.py), by id."""
        return {i: t.content for i, t in self.inner.get_added_tokens_decoder().items()
                if t.special and t.content in MARKERS}

    def stream(self) -> "Detokenizer":
        """An incremental decoder for generated ids (special tokens skipped, as `decode` does)."""
        return Detokenizer(self.decode)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size()

    def to_json(self, _=None) -> str:
        """tokenizer.json's text, as `tokenizers` writes it back."""
        return self.inner.to_str()

    def token_bytes(self, tok: int) -> bytes:
        """The bytes id `tok` stands for, alone: a byte-level BPE token's own bytes; a SentencePiece
        token with its ▁ as a space, or the byte of a <0xNN> fallback; a special token's text."""
        piece = self.inner.id_to_token(tok)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return bytes([int(fallback.group(1), 16)]) if fallback else piece.replace("\u2581", " ").encode()

    @cached_property
    def _byte_level(self) -> bool:
        decoder = json.loads(self.inner.to_str()).get("decoder") or {}
        kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
        return "ByteLevel" in kinds


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def added_as_text(tokenizer_json: str) -> str:
    """`tokenizer_json` with its added tokens that are not special (Qwen's <tool_call>, Qwen3's
    <think>) moved into the BPE vocabulary, spelled as its other entries are: a grammar engine
    (llguidance) reads every added token as special, so its masks offered such a token for the
    text it stands for and then refused it. Other models' JSON comes back unchanged."""
    raw = json.loads(tokenizer_json)
    model, decoder = raw.get("model") or {}, json.dumps(raw.get("decoder"))
    vocab = model.get("vocab")
    text = [a for a in raw.get("added_tokens") or [] if not a.get("special", True)]
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not text:
        return tokenizer_json
    to_char = {b: c for c, b in _byte_decoder().items()}
    for a in text:
        spelled = "".join(to_char[b] for b in a["content"].encode()) if "ByteLevel" in decoder \
            else a["content"].replace(" ", "\u2581")
        if vocab.setdefault(spelled, a["id"]) == a["id"]:  # (some vocabularies hold them already)
            raw["added_tokens"].remove(a)
    return json.dumps(raw, ensure_ascii=False)


def _post_processor_adds(inner: HFTokenizer, bos_id: int | None) -> bool:
    """Without tokenizer_config.json's add_bos_token: whether tokenizer.json itself would add BOS."""
    if bos_id is None:
        return False
    return inner.encode("a", add_special_tokens=True).ids[:1] == [bos_id] != \
        inner.encode("a", add_special_tokens=False).ids[:1]


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
