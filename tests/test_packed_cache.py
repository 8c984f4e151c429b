"""The packed-weight cache: built once, memory-mapped after, the same numbers either way, rebuilt when
stale, refused when damaged; and every kernel is cached by numba."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from larqlpy.errors import LarqlError
from larqlpy.weights import packed_cache
from larqlpy.weights.loader import load
from tiny import make_tiny, write_in_place

KERNELS = Path(__file__).resolve().parent.parent / "larqlpy" / "kernels"


@pytest.fixture
def tiny_dir(tmp_path):
    make_tiny(tmp_path / "m", sliding_window=16)
    return tmp_path / "m"


def logits(loaded, ids=(2, 40, 41, 42, 43)):
    from larqlpy.engines import EngineSpec, new_state
    from larqlpy.model.decoder import prefill

    state = new_state(EngineSpec(), loaded.model.geometries(), loaded.device)
    return prefill(loaded.model, state, list(ids), 64, all_logits=True)


@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
def test_built_once_then_mapped_with_the_same_numbers(tiny_dir, fmt):
    first = load(tiny_dir, device="cpu", weights=fmt)
    path = packed_cache.cache_path(tiny_dir, fmt, first.fingerprint)
    assert first.packed_from == "built" and path.is_file()
    again = load(tiny_dir, device="cpu", weights=fmt)
    assert again.packed_from == "cache"
    assert torch.equal(logits(first), logits(again))
    a, b = first.model.layers[1].q_proj.whole, again.model.layers[1].q_proj.whole
    for field in ("codes", "scale", "minimum"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or torch.equal(x, y)


def test_stale_cache_is_rebuilt_and_removed(tiny_dir):
    old = load(tiny_dir, device="cpu", weights="int8")
    old_path = packed_cache.cache_path(tiny_dir, "int8", old.fingerprint)
    w = load_file(str(tiny_dir / "model.safetensors"))
    w["model.layers.0.mlp.up_proj.weight"][0, 0] += np.float32(0.5)  # other weights: another fingerprint
    save_file(w, str(tiny_dir / "model.safetensors"))
    new = load(tiny_dir, device="cpu", weights="int8")
    assert new.fingerprint != old.fingerprint and new.packed_from == "built"
    assert not old_path.exists() and packed_cache.cache_path(tiny_dir, "int8", new.fingerprint).is_file()
    assert not torch.equal(logits(old), logits(new))


def test_an_edit_that_keeps_the_fingerprint_still_rebuilds(tiny_dir, monkeypatch):
    """The fingerprint samples only each end of a weight file; a cache packed from other bytes in
    between is stale all the same (the header holds the digest of each file it was packed from)."""
    from larqlpy.weights import checkpoint as files

    monkeypatch.setattr(files, "SAMPLE", 64)  # the tiny file's ends: like 1 MB of a 1 GB file's
    first = load(tiny_dir, device="cpu", weights="int8")
    assert first.packed_from == "built"
    name = "model.layers.1.mlp.up_proj.weight"
    write_in_place(tiny_dir / "model.safetensors", name, np.full(8, 0.75))
    again = load(tiny_dir, device="cpu", weights="int8")
    assert again.fingerprint == first.fingerprint  # the sample did not see it
    assert again.packed_from == "built"
    f32 = load(tiny_dir, device="cpu")
    up = again.model.layers[1].up_proj
    rows = up.whole.rows(torch.arange(up.lo, up.lo + 1))[0, :8]
    assert torch.equal(f32.model.layers[1].up_proj[0, :8], torch.full((8,), 0.75))
    assert torch.allclose(rows, torch.full((8,), 0.75), atol=0.02)  # packed from the edited bytes
    assert load(tiny_dir, device="cpu", weights="int8").packed_from == "cache"


def test_a_copy_of_the_same_bytes_keeps_the_cache(tiny_dir):
    """A weight file rewritten with the same bytes (a copy, a checkout) has a new identity: it is
    hashed again, found the same, and the cache serves."""
    first = load(tiny_dir, device="cpu", weights="int4")
    f = tiny_dir / "model.safetensors"
    data = f.read_bytes()
    f.unlink()
    f.write_bytes(data)  # another inode, other times
    again = load(tiny_dir, device="cpu", weights="int4")
    assert again.packed_from == "cache"
    assert torch.equal(logits(first), logits(again))


def test_cache_of_an_older_layout_is_stale_not_damaged(tiny_dir):
    """A cache written before the file layout changed (CRC32 checksums, no layout in its name) is
    rebuilt and removed, not refused."""
    first = load(tiny_dir, device="cpu", weights="int4")
    path = packed_cache.cache_path(tiny_dir, "int4", first.fingerprint)
    older = path.with_name(path.name.replace(f".{packed_cache.LAYOUT}.safetensors", ".safetensors"))
    assert older != path
    path.rename(older)
    again = load(tiny_dir, device="cpu", weights="int4")
    assert again.packed_from == "built" and path.is_file() and not older.exists()
    assert torch.equal(logits(first), logits(again))


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_cache_is_refused_in_one_line(tiny_dir, damage):
    good = load(tiny_dir, device="cpu", weights="int4")
    path = packed_cache.cache_path(tiny_dir, "int4", good.fingerprint)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 0x01
    else:
        data = bytearray(b"\x00" * 64)
    path.write_bytes(bytes(data))
    with pytest.raises(LarqlError) as e:
        load(tiny_dir, device="cpu", weights="int4")
    msg = str(e.value)
    assert "damaged packed-weight cache" in msg and str(path) in msg and "delete it" in msg and "\n" not in msg


def test_a_cache_of_another_model_directory_is_not_shared(tiny_dir, tmp_path):
    other = tmp_path / "copy"
    shutil.copytree(tiny_dir, other)
    load(tiny_dir, device="cpu", weights="int8")
    assert load(other, device="cpu", weights="int8").packed_from == "built"  # its own cache beside it


def test_every_numba_kernel_is_cached():
    """No JIT compile on a warm machine: numba writes every kernel's machine code to its cache."""
    missing = []
    for f in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "njit":
                        if not any(k.arg == "cache" and getattr(k.value, "value", None) is True for k in d.keywords):
                            missing.append(f"{f.name}:{node.name}")
    assert not missing, missing
