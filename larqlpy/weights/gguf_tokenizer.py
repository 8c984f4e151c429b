"""Tokenizers rebuilt from a GGUF's vocabulary with the `tokenizers` library, and the
tokenizer_config.json beside them (special tokens, BOS, the chat template).

- Gemma's SentencePiece BPE (tokenizer.ggml.model "llama" on gemma3): merges rebuilt from the vocabulary.
- Byte-level BPE (tokenizer.ggml.model "gpt2": SmolLM2, Llama 3, Qwen): the file's vocabulary and
  merges, split before BPE the way llama.cpp's pre-tokenizer type (tokenizer.ggml.pre) says.
- Gemma 4's BPE (tokenizer.ggml.model "gemma4"): the file's merges over UTF-8 characters, spaces
  written U+2581, the text cut into runs of newlines and runs of the rest (llama.cpp's gemma4
  pre-tokenizer), a character no token spells as its <0xXX> byte tokens.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from larqlpy.errors import LarqlError
from larqlpy.weights.gguf_archs import Meta
from larqlpy.weights.gguf_pretok import NAMES

# Gemma's special tokens where its file names none.
SENTENCEPIECE_IDS = {"tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.bos_token_id": 2,
                     "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.padding_token_id": 0}


def build_tokenizer(m: Meta):
    """(tokenizer, tokenizer_config) for the GGUF's vocabulary, its header checked by gguf_check (the
    tokenizer model and pre-tokenizer supported, token types one a token, ids in the vocabulary);
    the merges are checked here, as `tokenizers` builds the BPE."""
    if m.get("tokenizer.ggml.model") == "llama":  # gemma3's: gguf_check refuses it on the others
        tok, config = sentencepiece_bpe(m)
    elif m.get("tokenizer.ggml.model") == "gemma4":
        tok, config = gemma4_bpe(m)
    else:
        tok, config = byte_level_bpe(m)
    template = m.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return tok, config


def byte_level_bpe(m: Meta):
    tokens = list(m.get("tokenizer.ggml.tokens"))
    types = list(m.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = m.get("tokenizer.ggml.merges")
    spell = byte_spelling()
    alphabet = set(spell.values())
    # llama.cpp keeps the vocabulary in GPT-2's byte alphabet; a token outside it is respelled through it
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    rules = NAMES[m.get("tokenizer.ggml.pre", "default")]
    tok = merged_bpe(m, vocab, merges, byte_fallback=False, ignore_merges=rules.ignore_merges)
    # llama.cpp splits with each regex in turn, matches and the text between them each a piece
    tok.pre_tokenizer = pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), "isolated") for r in rules.regexes),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (type 3, e.g. <|im_end|>) are special; user-defined ones (type 4) match whole.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == 3 and t in vocab])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == 4 and t in vocab])
    return tok, _config(m, tokens, add_bos_default=rules.add_bos, cls="GPT2Tokenizer")


def merged_bpe(m: Meta, vocab: dict[str, int], merges: list[str], **options) -> Tokenizer:
    """A BPE of the file's vocabulary and "left right" merges; a merge that does not fit the
    vocabulary is refused in one line (`tokenizers` checks every merge as it builds; gguf_check leaves
    it that)."""
    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=[tuple(x.split(" ", 1)) for x in merges], dropout=None,
                                    fuse_unk=False, **options))
    except Exception as e:
        why = bad_merge(merges, vocab) or f"tokenizer.ggml.merges: {str(e).splitlines()[0]}"
        raise LarqlError(f"{m.reader.src}: {why}") from None


def bad_merge(merges: list[str], vocab: dict[str, int]) -> str | None:
    """What is wrong with the first merge that is not two tokens of the vocabulary (as the tokenizer
    spells it) and a space, making a third."""
    for i, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if not space:
            return f"tokenizer.ggml.merges[{i}] is {merge!r:.60}: not two tokens and a space"
        for t in (left, right, left + right):
            if t not in vocab:
                return (f"tokenizer.ggml.merges[{i}] is {merge!r:.60}: {t!r:.40} is not a token of "
                        "tokenizer.ggml.tokens (in GPT-2's byte spelling)")
    return None


def _config(m: Meta, tokens: list[str], add_bos_default: bool, cls: str) -> dict:
    def token(key: str) -> str | None:
        i = m.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {"add_bos_token": bool(m.get("tokenizer.ggml.add_bos_token", add_bos_default)),
              "add_eos_token": bool(m.get("tokenizer.ggml.add_eos_token", False)),
              "bos_token": token("tokenizer.ggml.bos_token_id"), "eos_token": token("tokenizer.ggml.eos_token_id"),
              "unk_token": token("tokenizer.ggml.unknown_token_id"),
              "pad_token": token("tokenizer.ggml.padding_token_id"), "tokenizer_class": cls}
    return {k: v for k, v in config.items() if v is not None}


def byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    other 68 are moved to U+0100 onwards (what byte-level BPE vocabularies are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def sentencepiece_bpe(m: Meta):
    """A `tokenizers` BPE tokenizer equivalent to the GGUF's SentencePiece vocabulary.

    (Gemma's: tokenizer.ggml.model "llama" on a gemma architecture.) The file carries no merges, so they
    are rebuilt: every split of a token into two tokens is a
    merge, ranked by the merged token's position in the vocabulary (Gemma's scores do not follow
    its merge order; positions do). Tokens made only of spaces are stored with real spaces but the
    normalizer turns spaces into U+2581, so they are respelled first.
    """
    tokens = list(m.get("tokenizer.ggml.tokens"))
    types = list(m.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = []
    for token, index in vocab.items():
        local = [(token[:j], token[j:], index) for j in range(1, len(token))
                 if token[:j] in vocab and token[j:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (-m[2], len(m[0]), len(m[1])), reverse=True)
    ids = {k: int(m.get(k, v)) for k, v in SENTENCEPIECE_IDS.items()}
    unk = tokens[ids["tokenizer.ggml.unknown_token_id"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(left, right) for left, right, _ in merges], unk_token=unk,
                               fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens (type 3) are special; user-defined ones (type 4, e.g. "\n\n") match whole.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == 4 and t in vocab])
    bos_id = ids["tokenizer.ggml.bos_token_id"]
    _bos_first(tok, m, tokens, bos_id)
    config = {"add_bos_token": bool(m.get("tokenizer.ggml.add_bos_token", True)),
              "add_eos_token": bool(m.get("tokenizer.ggml.add_eos_token", False)),
              "bos_token": tokens[bos_id], "eos_token": tokens[ids["tokenizer.ggml.eos_token_id"]],
              "unk_token": unk, "pad_token": tokens[ids["tokenizer.ggml.padding_token_id"]],
              "tokenizer_class": "GemmaTokenizer"}
    return tok, config


def _bos_first(tok: Tokenizer, m: Meta, tokens: list[str], bos_id: int) -> None:
    """BOS before the text, unless the file says not to add it (Gemma's add it by default)."""
    if bool(m.get("tokenizer.ggml.add_bos_token", True)):
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])


def gemma4_bpe(m: Meta):
    """Gemma 4's BPE as llama.cpp runs it (its gemma4 pre-tokenizer: no byte remapping)."""
    tokens = list(m.get("tokenizer.ggml.tokens"))
    types = list(m.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = m.get("tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = merged_bpe(m, vocab, merges, byte_fallback=True)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), "isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4])
    _bos_first(tok, m, tokens, int(m.get("tokenizer.ggml.bos_token_id", 2)))
    return tok, _config(m, tokens, add_bos_default=True, cls="GemmaTokenizer")
