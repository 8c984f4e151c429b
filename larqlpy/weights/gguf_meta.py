"""A GGUF's header, read and checked (weights/gguf_check.py), and the files a model directory holds
beside its weights (config.json, generation_config.json, tokenizer.json, tokenizer_config.json),
without torch: what `convert-gguf` writes into its directory and a .gguf run directly into its
metadata cache (weights/gguf_file.py)."""

from __future__ import annotations

import json
from pathlib import Path

from larqlpy.errors import LarqlError
from larqlpy.weights.gguf_archs import ARCHS, Arch, Meta
from larqlpy.weights.gguf_check import Reader, check_header


def read_gguf(src: Path, pre_tokenizer: str | None = None) -> tuple[Meta, Arch]:
    """The file's metadata and architecture, its header checked whole (gguf_check) before anything is
    built from it; pre_tokenizer: split text as this llama.cpp name does, not as tokenizer.ggml.pre says."""
    if src.is_dir():
        raise LarqlError(f"{src}: is a directory, not a GGUF file")
    if not src.is_file():
        raise LarqlError(f"{src}: no such file")
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LarqlError(f"{src}: not a readable GGUF file (it does not start with the GGUF magic)")
    try:
        reader = Reader(src)
    except LarqlError:
        raise
    except Exception:  # gguf's reader fails on a short file with numpy's own words
        raise LarqlError(f"{src}: not a readable GGUF file "
                         f"(truncated or damaged: {src.stat().st_size:,} bytes)") from None
    arch = reader.fields.get("general.architecture")
    arch = None if arch is None else arch.contents()
    if arch is None:
        raise LarqlError(f"{src}: not a model GGUF (it has no general.architecture)")
    if not isinstance(arch, str) or arch not in ARCHS:
        raise LarqlError(f"{src}: general.architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")
    meta = Meta(reader, arch, None if pre_tokenizer is None else {"tokenizer.ggml.pre": pre_tokenizer})
    check_header(src, meta)
    return meta, ARCHS[arch]


def write_metadata(dest: Path, config: dict, tokenizer, tok_config: dict) -> None:
    """config.json, generation_config.json, tokenizer.json and tokenizer_config.json into `dest`:
    what a converted directory and a GGUF's metadata cache (weights/gguf_file.py) hold beside the
    weights."""
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"]}, indent=2) + "\n")
    save_tokenizer(tokenizer, dest / "tokenizer.json")
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def save_tokenizer(tok, path: Path) -> None:
    """tokenizer.json, with the merges in the "left right" spelling when no token holds a space:
    `tokenizers` reads that spelling of a large merge list in half the time of [left, right] pairs,
    at every start-up."""
    data = json.loads(tok.to_str())
    model = data.get("model", {})
    merges = model.get("merges") or []
    if merges and isinstance(merges[0], list) and not any(" " in t for t in model.get("vocab", {})):
        model["merges"] = [" ".join(m) for m in merges]
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")))  # read by machines: no spaces
