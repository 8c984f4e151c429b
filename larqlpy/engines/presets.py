"""Named engine configurations: the one place the CLI, benches, docs and tests take them from.

A preset is (identity, ((option, value), ...)): data, validated when it is turned into a spec
(`registry.preset_spec`), so a preset that stops being valid fails loudly.
"""

from __future__ import annotations

Preset = tuple[str, tuple[tuple[str, object], ...]]

# The recommended approximate configuration (bench/kv_mixed.py, docs/codec.md): about 4.4 bits per
# value at 1.5K positions on the 270M, KL 0.005. COMPACT: about 3.4 bits, KL 0.02 (beats llama.cpp's
# q4_0 KV cache at 4.5 bits, KL 0.06).
# codec/v1's options when not given: what holds on every family (issue 30: calibrated keys, one exact
# sink row, the newest 16 rows at 8 bits). CODEC_PLAIN is what they meant before they had defaults
# (LARQL's plain codec): a state saved then, without them, resumes as it was saved.
CODEC_DEFAULTS: tuple[tuple[str, object], ...] = (("calib", "auto"), ("recent", 16), ("sink", 1))
CODEC_PLAIN: tuple[tuple[str, object], ...] = (("calib", "off"), ("recent", 0), ("sink", 0))

PLAIN4: Preset = ("codec/v1", (("bits", 4), *CODEC_PLAIN))
PLAIN3: Preset = ("codec/v1", (("bits", 3), *CODEC_PLAIN))

RECOMMENDED: Preset = ("codec/v1", (("bits", 4), ("calib", "on"), ("recent", 16), ("sink", 1)))
COMPACT: Preset = ("codec/v1", (("bits", 3), ("calib", "on"), ("recent", 16), ("sink", 1)))

# `bench ladder` and `bench consistency` run these when no engine is named (consistency skips the first).
LADDER: list[Preset] = [
    ("canonical/v1", ()), ("window/v1", ()), PLAIN4, PLAIN3,
    ("codec-recent/v1", (("bits", 4), ("exact_recent_k", 64))), ("int4-group/v1", ()),
]

# `residency` shows these when no engine is named: every provider, with the options that show its range.
RESIDENCY: list[Preset] = [
    ("canonical/v1", ()), ("window/v1", ()),
    PLAIN4, PLAIN3, RECOMMENDED, COMPACT,
    ("codec-recent/v1", (("bits", 4), ("exact_recent_k", 64))), ("int4-group/v1", ()), ("cells/v1", ()),
]

# One of each engine and option family, sized for the tiny test models (window 16, 3 layers of each
# kind): what the save/resume tests run every engine through.
SPREAD: list[Preset] = [
    ("canonical/v1", ()), ("window/v1", ()), PLAIN4, PLAIN3, ("codec/v1", (("bits", 4),)),
    ("codec-recent/v1", (("bits", 4), ("exact_recent_k", 8))), ("int4-group/v1", (("group", 8),)),
    ("cells/v1", ()), ("cells/v1", (("budget", "160KiB"),)),
    ("codec/v1", (("k_bits", 5), ("v_bits", 3), ("sink", 4), ("layer_bits", "1:8/2,2:exact"))),
    ("codec-recent/v1", (("k_bits", 8), ("v_bits", 2), ("sink", 3), ("exact_recent_k", 5))),
]


def option_texts(preset: Preset) -> list[str]:
    """The preset's options as `key=value` strings (how options arrive from any interface)."""
    return [f"{k}={v}" for k, v in preset[1]]
