"""GGUF (llama.cpp) -> Hugging Face layout: f32 safetensors, config.json, tokenizer.json and
tokenizer_config.json (with the chat template), for the architectures in weights/gguf_archs.py; and
beside them native.safetensors, the quantized matrices as their own integer codes
(convert/native.py), which `weights` native runs.

GGUF conventions minded here: tensor shapes are listed innermost-first (the numpy view the `gguf`
package gives is already [rows, cols] = HF's [out, in]); each architecture's own conventions
(norms stored as 1 + w, permuted q/k rows) are in weights/gguf_archs.py, its tokenizer in
weights/gguf_tokenizer.py, what is checked before either is read in weights/gguf_check.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from larqlpy.convert.native import native_codes
from larqlpy.errors import LarqlError
from larqlpy.files import atomic_directory, check_output, check_room
from larqlpy.model.families import config_from_dict, read_config
from larqlpy.weights import native_file
from larqlpy.weights.checkpoint import Checkpoint, check_finite, wanted_tensors
from larqlpy.weights.gguf_archs import Arch
from larqlpy.weights.gguf_check import refuse_unused, unused_tensors
from larqlpy.weights.gguf_meta import read_gguf, write_metadata
from larqlpy.weights.gguf_pretok import check_name
from larqlpy.weights.gguf_tokenizer import build_tokenizer

Progress = Callable[[str, int, int], None]  # (what, done, total)


def convert_gguf(src: str | Path, dest: str | Path, progress: Progress | None = None, force: bool = False,
                 dtype: str = "bfloat16", allow_unused_tensors: bool = False, pre_tokenizer: str | None = None) -> Path:
    """Dequantize a GGUF (gemma3, llama, qwen2, qwen3, granite, starcoder2) into an HF-layout
    directory, written to a temp directory and renamed when whole. dtype: what the quantized
    matrices are written as -- bfloat16 (half the bytes; a GGUF's values are rarely bfloat16
    exactly) or float32 (exact); matrices the file holds as float stay in their own precision where
    dtype is bfloat16, and norms and biases are float32. A file holding tensors its architecture does
    not take is refused (as `run` refuses it) unless `allow_unused_tensors`; they are not written.
    pre_tokenizer: the tokenizer written splits text as this llama.cpp name does, not as the file's
    tokenizer.ggml.pre says."""
    src, dest = Path(src), Path(dest)
    if dtype not in STORED:
        raise LarqlError(f"`dtype`: expected {' or '.join(STORED)}, got {dtype!r}")
    if dest.exists() and not force:
        raise LarqlError(f"{dest}: already exists (pass `force` to overwrite)")
    check_output(dest, "DEST", inputs=[src], directory=True)
    if pre_tokenizer is not None:
        check_name(pre_tokenizer)
    meta, arch = read_gguf(src, pre_tokenizer)
    config = arch.config(meta)
    refuse_unwritten(src, config)
    ours = used_tensors(src, meta.reader.tensors, arch, config, allow_unused_tensors)
    check_room(dest, written_bytes(ours, dtype), "DEST")
    step = progress or (lambda what, done, total: None)
    total = len(ours) + 1
    step("tokenizer", 0, total)
    tokenizer = build_tokenizer(meta)  # before the tensors: a bad vocabulary is refused before minutes of work
    tensors: dict[str, torch.Tensor] = {}
    codes: dict[str, tuple] = {}
    floats: dict[str, str] = {}
    for i, (t, (name, is_norm)) in enumerate(ours):
        step(f"dequantize {t.name}", i + 1, total)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as e:
            raise LarqlError(f"{src}: cannot dequantize {t.name} ({t.tensor_type.name}: {e})") from None
        expected = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        w = w.reshape(expected)
        check_finite(src, t.name, w)
        if len(expected) == 2 and not is_norm:
            parts = native_codes(f"{src}: {t.name}", t.data, t.tensor_type, expected, w)
            if parts is None:
                floats[name] = t.tensor_type.name
            else:  # q/k rows permuted back like the weights: codes and scales are per row
                u, scale, minimum, zero, bits = parts
                codes[name] = (arch.restore(t.name, u, config), arch.restore(t.name, scale, config),
                               None if minimum is None else arch.restore(t.name, minimum, config),
                               zero, bits, t.tensor_type.name)
        tensors[name] = stored(arch.hf_values(t.name, w, config, is_norm), t.tensor_type.name, dtype)

    write_directory(src, dest, tensors, {**config, "torch_dtype": dtype}, tokenizer, codes, floats)
    step("done", total, total)
    return dest


def refuse_unwritten(src: Path, config: dict) -> None:
    """The architectures that run from the GGUF file itself and have no directory form here."""
    parsed = config_from_dict(config)
    if parsed.moe is not None:
        raise LarqlError(f"{src}: a mixture of experts ({config['model_type']}) runs from the GGUF file itself; "
                         "convert-gguf does not write experts")
    if parsed.layout == "gpt2":  # a directory holds GPT-2's Conv1D matrices transposed
        raise LarqlError(f"{src}: gpt2 runs from the GGUF file itself; convert-gguf does not write GPT-2's layout")


def write_directory(src: Path, dest: Path, tensors: dict, config: dict, tokenizer: tuple, codes: dict,
                    floats: dict) -> None:
    """The converted directory, written whole into a temp directory and renamed: a crash leaves no
    half-written model directory."""
    with atomic_directory(dest, replace=True) as tmp:
        try:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": src.name})
        except SafetensorError as e:  # a disk filled by another writer since check_room: one line
            raise LarqlError(f"DEST {dest}: cannot write model.safetensors ({e})") from None
        write_metadata(tmp, config, *tokenizer)
        fingerprint = Checkpoint(tmp, read_config(tmp)).fingerprint  # not the path
        native_file.write(tmp / native_file.FILE, codes, floats, fingerprint)


def used_tensors(src: Path, tensors: list, arch: Arch, config: dict, allow_unused_tensors: bool) -> list:
    """(tensor, (HF name, stored as 1 + w)) for each tensor the architecture takes; the others refused
    unless allowed (then left out), and a missing one refused, before any is read."""
    ours = [(t, arch.hf_name(t.name)) for t in tensors]
    wanted = wanted_tensors(src, config_from_dict(config), {m[0]: src for _, m in ours if m is not None})
    used = {hf for hf, _ in wanted.values()}
    unused = unused_tensors([t.name for t in tensors], arch, used)
    if unused and not allow_unused_tensors:
        refuse_unused(src, arch, unused)
    return [(t, m) for t, m in ours if m is not None and m[0] in used]


STORED = ("bfloat16", "float32")


def written_bytes(ours: list, dtype: str) -> int:
    """About what convert_gguf writes: each tensor at `dtype` (norms and biases at float32, a float
    matrix at its own width where dtype is bfloat16), and the quantized ones again as their codes."""
    total = 0
    for t, _ in ours:
        n = int(np.prod(t.shape))
        wide = dtype == "float32" or len(t.shape) < 2
        total += n * (4 if wide else 2) + (0 if t.tensor_type.name in OWN else int(t.n_bytes))
    return total
OWN = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def stored(w: np.ndarray, qtype: str, dtype: str) -> torch.Tensor:
    """A dequantized float32 tensor as the converted checkpoint stores it (convert_gguf's dtype)."""
    w = np.ascontiguousarray(w)
    t = torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 ones come from the read-only map
    if dtype == "float32" or t.ndim < 2:
        return t
    return t.to(OWN.get(qtype, torch.bfloat16))
