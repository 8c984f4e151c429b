"""llama.cpp's pre-tokenizers, by the name a GGUF gives in tokenizer.ggml.pre: the regexes that split
text into the pieces byte-level BPE merges within, applied one after another (each splits the pieces
the one before left, a match and the text between matches each a piece), and the rules that come with
the name (src/llama-vocab.cpp: `llm_tokenizer_bpe` and the name map in `llama_vocab::impl::load`).

The regexes are llama.cpp's own spelling (its "adapted" forms where it rewrote a tokenizer.json's),
run by `tokenizers`' Oniguruma: tests/test_pretokenizers.py holds the ids equal to llama.cpp's
tokenizer on every name the installed llama.cpp knows.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from larqlpy.errors import LarqlError


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a token of the vocabulary is taken whole
    add_bos: bool = False  # where the file does not say (tokenizer.ggml.add_bos_token)


_S = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # contractions, either case
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _S + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _S + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = _S + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_JAIS2 = _S + (r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               + "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}")
# llama.cpp's regexes meet non-ASCII whitespace as \s alone, never as a character of a class (it runs
# them over the text with such spaces replaced by U+000B): these classes leave those spaces out.
_SPACES = "\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CJK = f"[一-龥ࠀ-一가-퟿&&[^{_SPACES}]]+"
# NFC folds some of these letters onto others (Greek oxia forms, ohm, kelvin): escaped so nothing rewrites them
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄ"
    "ῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻"
    "𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+")
_DEEPSEEK3 = (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's stand-in for \p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M} (upper: a letter not a-z) and for
# \p{Ll}\p{Lm}\p{Lo}\p{M} (lower: a letter not A-Z), which its own regex engine cannot read.
_UP, _LOW = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LOW}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LOW}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LOW}+{_S}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LOW}*{_S}?|\p{{N}}{{1,3}}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UP_M, _LOW_M = r"((?=[\p{L}\p{M}])([^a-z]))", r"((?=[\p{L}\p{M}])([^A-Z]))"
_GRANITE_MULTI = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP_M}*{_LOW_M}+{_S}?|[^\r\n\p{{L}}\p{{N}}]?{_UP_M}+{_LOW_M}*{_S}?"
                  r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_AYA = (rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED[0]}*{_CASED[1]}+{_S}?|[^\r\n\p{{L}}\p{{N}}]?{_CASED[0]}+{_CASED[1]}*{_S}?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_YOUTU = ("[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
          rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED[0]}*{_CASED[1]}+{_S}?|[^\r\n\p{{L}}\p{{N}}]?{_CASED[0]}+{_CASED[1]}*{_S}?"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_FINNISH = " ?[^(\\s|.,!?…。，、।۔،)]+"

# pre-tokenizer type -> its rules (llm_tokenizer_bpe's switch)
TYPES = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "llama3": PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": PreTokenizer((LLAMA3,)),
    "jais2": PreTokenizer((_JAIS2,)),
    "deepseek-llm": PreTokenizer(("[\r\n]", _DEEPSEEK_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟、-。]+", r"\s+$", _CJK,
                                  r"\p{N}+")),
    "deepseek3": PreTokenizer(_DEEPSEEK3),
    "spark2_5": PreTokenizer((*_DEEPSEEK3[:2], _DEEPSEEK3[2].replace(r"[\r\n]*|\s*[\r\n]+", r"|[\r\n]"), r"\p{N}")),
    "youtu": PreTokenizer(_YOUTU, ignore_merges=True),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    "starcoder": PreTokenizer((r"\p{N}", GPT2)),
    "gpt2": PreTokenizer((GPT2,)),
    "qwen2": PreTokenizer((QWEN2,)),
    "qwen35": PreTokenizer((QWEN35,)),
    "poro": PreTokenizer((_FINNISH,)),
    "chatglm4": PreTokenizer((LLAMA3,)),
    "viking": PreTokenizer((_FINNISH, r"\p{N}")),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": PreTokenizer(("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )",
                               r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2), add_bos=True),
    "gpt4o": PreTokenizer((_GPT4O,)),
    "granite-multi": PreTokenizer((_GRANITE_MULTI,), ignore_merges=True),
    "tiny-aya": PreTokenizer((r"\d{1,3}(?=(?:\d{3})*\b)", _AYA)),
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))")),
    "bailingmoe": PreTokenizer((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "seed-coder": PreTokenizer((_S + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                                     r"|\s+(?!\S)|\s+",)),
    "ufakzeka": PreTokenizer((QWEN2[len(_S) + 1:],)),
    "laguna": PreTokenizer(("[^\\n]+|[\\n]+", QWEN2)),
    "exaone-moe": PreTokenizer((_S + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                                     r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _S + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
}

_GROUPS = {  # tokenizer.ggml.pre -> its type (llama_vocab::impl::load)
    "default": "default", "minicpm5": "minicpm5",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), "llama3"),
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder", "spark2_5": "spark2_5", "youtu": "youtu",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), "deepseek3"),
    "falcon": "falcon",
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais",
                     "exaone4", "trillion", "granite-docling"), "gpt2"),
    "jais-2": "jais2",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    "starcoder"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
                     "grok-2"), "qwen2"),
    "qwen35": "qwen35", **dict.fromkeys(("dbrx", "smaug-bpe"), "dbrx"),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), "poro"),
    **dict.fromkeys(("glm4", "chatglm-bpe"), "chatglm4"), "viking": "viking", "tekken": "tekken",
    "chameleon": "chameleon",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
    "granite-embed-multi-97m": "granite-multi", **dict.fromkeys(("tiny_aya", "cohere2moe"), "tiny-aya"),
    "superbpe": "superbpe", **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "seed-coder": "seed-coder", "ufakzeka": "ufakzeka", "laguna": "laguna", "exaone-moe": "exaone-moe",
}
NAMES: dict[str, PreTokenizer] = {name: TYPES[kind] for name, kind in _GROUPS.items()}
# Names llama.cpp knows whose splitting is not a sequence of regexes over GPT-2's byte alphabet.
NOT_REGEX = {
    "kimi-k2": "its splitting is hand-written in llama.cpp (Han characters excluded from the letter classes)",
    "afmoe": "its digit grouping is hand-written in llama.cpp",
    "gemma4": "it is SentencePiece-style BPE over raw UTF-8, not byte-level",
    "granite-embed-multi-311m": "it is SentencePiece-style BPE over raw UTF-8, not byte-level",
    "sarvam-moe": "it is SentencePiece-style BPE over raw UTF-8, not byte-level",
    "whitespace": "it splits at whitespace over raw UTF-8 (an embedding model's)",
}


def unknown(name) -> str | None:
    """Why tokenizer.ggml.pre `name` cannot be run (the closest known names and the parameter that
    overrides it), or None."""
    why = _why(name)
    if why is None or not isinstance(name, str) or name in NOT_REGEX:
        return why  # nothing another name would mend
    return why + "; `pre_tokenizer` NAME splits text as NAME does"


def _why(name) -> str | None:
    if not isinstance(name, str):
        return "not a string"
    if name in NAMES:
        return None
    if name in NOT_REGEX:
        return f"not supported ({NOT_REGEX[name]})"
    close = difflib.get_close_matches(name.lower(), NAMES, n=3, cutoff=0.5)
    hint = f"closest: {', '.join(close)}; " if close else ""
    return f"not a pre-tokenizer llama.cpp knows ({hint}{len(NAMES)} known, listed in docs/weights.md)"


def check_name(name: str) -> None:
    """A pre-tokenizer name given to override the file's, checked before anything loads."""
    if (why := _why(name)) is not None:
        raise LarqlError(f"`pre_tokenizer` {str(name)[:60]!r}: {why}")
