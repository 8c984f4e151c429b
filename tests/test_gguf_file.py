"""A .gguf file run directly (weights/gguf_file.py, weights/gguf_checkpoint.py, kernels/weights/gguf_blocks.py):
the same weights as its converted directory, code for code; the metadata cache made once, kept while
the file keeps its bytes, rebuilt when they change; refusals of bad files in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from larqlpy.convert.native import SUPPORTED, decompose
from larqlpy.errors import LarqlError
from larqlpy.kernels import cpu
from larqlpy.kernels.weights import gguf_blocks
from larqlpy.kernels.weights.gguf_blocks import (INDEX, JOINT, LAYOUTS, TWO_LEVEL, BlockRows, packed_width,
                                                 tiled_arrays, unpack, unpack_tiled)
from larqlpy.kernels.weights.qweight import TILE, PackedWeight, tile_codes
from larqlpy.kernels.weights.simd import fits, layout_bits
from larqlpy.weights import gguf_file
from larqlpy.weights.gguf_file import GGUFFile, metadata_dir
from larqlpy.weights.loader import load
from conftest import QWEN_DIR, ROOT, smol_gguf
from test_native import random_blocks

Q = gguf.GGMLQuantizationType
QWEN_GGUF = ROOT / "models" / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"


@pytest.fixture(scope="session")
def links(tmp_path_factory, gemma_gguf) -> dict[str, Path]:
    """The three reference GGUFs, linked into a folder of the tests' own (so their metadata caches
    are made there, beside the links)."""
    d = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, src in (("gemma", gemma_gguf), ("smol", smol_gguf()), ("qwen", QWEN_GGUF)):
        if not src.is_file():
            pytest.fail(f"{src} is missing: run `make model` (make test does it)")
        out[name] = d / f"{name}.gguf"
        out[name].symlink_to(src)
    return out


def test_layouts_cover_what_native_holds():
    """Every type convert/native.py holds as codes, and the ones only a .gguf run directly does
    (tests/test_gguf_quants.py holds those against gguf-py itself)."""
    assert set(LAYOUTS) == set(SUPPORTED) | {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "IQ3_S", "IQ3_XXS",
                                             "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}


@pytest.mark.parametrize("name", SUPPORTED)
def test_block_bytes_unpack_to_the_reference_codes(name):
    """The numba unpacker gives convert/native.py's codes (gguf-py's dequantizer probed), exactly."""
    qtype = Q[name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = 5, 3 * 256 if block == 256 else 7 * 32
    data = random_blocks(qtype, n * k // block, seed=7 + len(name)).reshape(n, -1)
    want, got = decompose(data, qtype, (n, k)), unpack(data, name, (n, k))
    for a, b in zip(want, got):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_float_types_are_not_unpacked():
    assert unpack(np.zeros(8, np.uint8), "F16", (2, 2)) is None


@pytest.mark.parametrize("bits,zero", [(8, 128), (4, 8), (4, 0), (5, 16), (6, 32)])
@pytest.mark.parametrize("n", [TILE, TILE + 3, 2 * TILE - 1])
def test_tiling_matches_the_layout_the_kernels_read(bits, zero, n):
    rng = np.random.default_rng(n + bits)
    u = rng.integers(0, 2 ** bits, (n, 96), dtype=np.uint8)
    padded = np.concatenate([u, np.full((-n % TILE, 96), zero if bits in (8, 4) else 0, np.uint8)])
    m = padded.shape[0]
    if bits == 8:
        want = padded.reshape(m // TILE, TILE, 24, 4).transpose(0, 2, 1, 3)
    else:
        v = padded.reshape(m // TILE, TILE, 12, 2, 4) & 15
        want = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).transpose(0, 2, 1, 3)
        if bits > 4:  # a word per row per 4 / p octets: byte i, field 2 (o mod 4/p) + h = high bits of 8o+4h+i
            p = bits - 4
            per, slots = 4 // p, TILE * p // 4
            high = (padded.reshape(m // TILE, TILE, 12 // per, per * 2, 4) >> 4).astype(np.uint32)
            words = (high << (p * np.arange(per * 2))[:, None]).sum(3).astype(np.uint8)  # (tiles, TILE, 12/per, 4)
            # rows [a slots, (a + 1) slots) of octet group G lie in octet G per + a's area
            areas = words.reshape(m // TILE, per, slots, 12 // per, 4).transpose(0, 3, 1, 2, 4)
            want = np.concatenate([want, areas.reshape(m // TILE, 12, slots, 4)], axis=2)
    assert np.array_equal(tile_codes(u, bits, zero), want)


def same_weights(a, b) -> None:
    wa, wb = a.held_weights(), b.held_weights()
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        if isinstance(x, BlockRows):  # an untied embedding left in the file: the rows the packed codes give
            idx = torch.cat([torch.tensor([0, x.shape[0] - 1]), torch.randint(0, x.shape[0], (500,))])
            assert torch.equal(x.rows(idx.view(2, -1)), y.rows(idx.view(2, -1)))
            continue
        assert type(x) is type(y)
        if isinstance(x, PackedWeight):
            assert x.meta() == y.meta()
            assert torch.equal(x.codes, y.codes)
            for f, tx, ty in zip(("scale", "minimum"), x.group_values(), y.group_values()):
                assert (tx is None) == (ty is None) and (tx is None or torch.equal(tx, ty)), f
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("model", [pytest.param("gemma", marks=pytest.mark.heavy), "smol", "qwen"])  # the
# 270M's K-quant mix is heavy here: CI keeps Qwen's (the same block types) and test_native's gemma check
def test_a_gguf_runs_its_own_codes_as_its_converted_directory_does(links, model, real_dir, smol_dir):
    """Gemma (1 + w norms, tied head, Q4_K_M mix), SmolLM2 (llama's permuted q/k rows, Q4_1), Qwen2.5
    (biases, Q5_0 / Q8_0 / Q6_K / Q4_K): loaded from the .gguf, every matrix holds the codes, scales
    and minimums `native` loads from the converted directory, and every float tensor is equal."""
    directory = {"gemma": real_dir, "smol": smol_dir, "qwen": QWEN_DIR}[model]
    direct = load(links[model], device="cpu")
    assert direct.weights == "native" and direct.packed_from == "file"  # the default: what the file holds
    assert direct.home == metadata_dir(links[model]) and direct.home.name == f"{model}.gguf.larqlpy"
    # the untied embedding (Qwen's) is only gathered from: it stays in the file's blocks
    assert isinstance(direct.model.embed_tokens, BlockRows) == (model == "qwen")
    same_weights(direct, load(directory, device="cpu", weights="native"))


def test_each_matrix_runs_at_its_files_width_and_stacks_only_with_its_own(links):
    """The 0.5B: Q5_0 at 5 bits, Q6_K at 6, Q8_0 at 8, Q4_K at 4 -- the file's bytes, give or take the
    K-quants' float32 sub-block scales; q_proj and k_proj (Q5_0) stack, a Q8_0 v_proj runs alone, and
    one product serves each stack however its parts are asked for."""
    from larqlpy.kernels.weights.matvec import linears
    from larqlpy.kernels.weights.qweight import PackedPart

    direct = load(links["qwen"], device="cpu")
    f = GGUFFile(links["qwen"])
    width = {"Q5_0": "u5", "Q6_K": "u6", "Q8_0": "u8", "Q4_K": "u4"}
    saw_alone = False
    for i, b in enumerate(direct.model.layers):
        assert isinstance(b.q_proj, PackedPart) and b.k_proj.whole is b.q_proj.whole
        assert b.q_proj.whole.kind == width[f.tensors[f"blk.{i}.attn_q.weight"][0]]
        v_type = f.tensors[f"blk.{i}.attn_v.weight"][0]
        assert isinstance(b.v_proj, PackedPart) == (v_type == "Q5_0")
        saw_alone |= not isinstance(b.v_proj, PackedPart)
        whole = b.down_proj.whole if isinstance(b.down_proj, PackedPart) else b.down_proj
        assert whole.kind == width[f.tensors[f"blk.{i}.ffn_down.weight"][0]]
    assert saw_alone
    b = direct.model.layers[0]
    x = torch.randn(2, b.q_proj.shape[1])
    q, v, k = linears(x, b.q_proj, b.v_proj, b.k_proj)
    whole = b.q_proj.whole.matmul(x)
    assert torch.equal(q, whole[:, b.q_proj.lo:b.q_proj.hi]) and torch.equal(k, whole[:, b.k_proj.lo:b.k_proj.hi])
    assert torch.equal(v, b.v_proj.matmul(x))
    file_bytes = sum(t[3] for n, t in f.tensors.items() if n.startswith("blk.") and t[0] != "F32")
    packed = sum(w.nbytes for w in direct.held_weights() if isinstance(w, PackedWeight)) - \
        direct.model.head.nbytes
    assert packed < 1.08 * file_bytes  # the layers' matrices (was 1.4x with 5- and 6-bit codes as bytes)


@pytest.mark.parametrize("model", [pytest.param("gemma", marks=pytest.mark.heavy), "smol"])
def test_float32_from_a_gguf_is_the_converted_checkpoint(links, model, real_dir, smol_dir):
    directory = {"gemma": real_dir, "smol": smol_dir}[model]
    same_weights(load(links[model], device="cpu", weights="f32"), load(directory, device="cpu", weights="f32"))


def test_low_bit_formats_pack_from_a_gguf_into_its_metadata_cache(links, smol_dir):
    direct = load(links["smol"], device="cpu", weights="int4")
    assert direct.packed_from in ("built", "cache")
    assert list((direct.home / ".larqlpy-cache").glob("packed-int4-*.safetensors"))
    again = load(links["smol"], device="cpu", weights="int4")
    assert again.packed_from == "cache"
    same_weights(direct, load(smol_dir, device="cpu", weights="int4"))


def test_the_metadata_cache_is_made_once_and_holds_while_the_bytes_do(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    shutil.copyfile(smol_gguf(), src)
    told = []
    first = GGUFFile(src, told.append)  # told where, before the header is read
    cache = tmp_path / "m.gguf.larqlpy"
    assert told == [cache] and gguf_file.model_dir(src, told.append) == cache and told == [cache]
    assert first.dir == cache and (cache / "config.json").is_file() and (cache / "tokenizer.json").is_file()
    disk = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    assert disk < 0.05 * src.stat().st_size  # the metadata cache is all a GGUF adds on disk

    def no_parse(*a, **k):
        raise AssertionError("the header was parsed again")

    monkeypatch.setattr(gguf_file, "read_gguf", no_parse)
    assert GGUFFile(src).fingerprint == first.fingerprint  # from the record
    os.utime(src, ns=(0, 0))  # a new identity, the same bytes: kept, the record rewritten
    assert GGUFFile(src).fingerprint == first.fingerprint
    assert json.loads((cache / "gguf.json").read_text())["identity"][3] == 0
    monkeypatch.undo()
    with open(src, "r+b") as f:  # other bytes at the end: another fingerprint, the cache rebuilt
        f.seek(-16, os.SEEK_END)
        f.write(b"\x00" * 16)
    assert GGUFFile(src).fingerprint != first.fingerprint


def test_a_read_only_folder_keeps_the_cache_under_the_users_cache(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    src = folder / "m.gguf"
    src.symlink_to(smol_gguf())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != folder)
    d = GGUFFile(src).dir
    assert d.parent == tmp_path / "home-cache" / "larqlpy" / "gguf" and (d / "config.json").is_file()
    assert not (folder / "m.gguf.larqlpy").exists()


def test_bad_gguf_files_are_refused_in_one_line(tmp_path):
    short = tmp_path / "short.gguf"
    with open(smol_gguf(), "rb") as f:
        short.write_bytes(f.read(1 << 20))  # the header whole, the tensors cut off
    with pytest.raises(LarqlError, match="truncated") as e:
        load(short, device="cpu")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "short.gguf.larqlpy").exists()


def test_the_cli_runs_a_gguf_and_says_so(links, smol_dir):
    """`run FILE.gguf` answers as the converted directory does at `--weights native`, runs at int4 in a
    fresh process, and `info` reads the file."""
    cmd = [sys.executable, "-m", "larqlpy.cli.main"]
    prompt = ["What is the capital of France?", "--chat", "-n", "12", "--json"]
    direct = subprocess.run([*cmd, "run", str(links["smol"]), *prompt], capture_output=True, text=True, check=True)
    converted = subprocess.run([*cmd, "run", str(smol_dir), *prompt, "--weights", "native"],
                               capture_output=True, text=True, check=True)
    a, b = json.loads(direct.stdout), json.loads(converted.stdout)
    assert a["weights"] == "native" and a["text"] == b["text"] and a["tokens"] == b["tokens"]
    int4 = subprocess.run([*cmd, "run", str(links["smol"]), *prompt, "--weights", "int4"], capture_output=True,
                          text=True, check=True)  # dequantized from the blocks by gguf-py, then packed
    assert json.loads(int4.stdout)["weights"] == "int4"
    info = subprocess.run([*cmd, "info", str(links["smol"]), "--json"], capture_output=True, text=True, check=True)
    d = json.loads(info.stdout)
    assert d["model_type"] == "llama" and "Q4_1" in d["dtypes"]


def test_k_quants_and_float_scaled_blocks_repack_through_one_compiled_kernel():
    """Q4_K and Q6_K (integer sub-block scales) and Q8_0 and Q5_0 (float32 scales) -- a Q4_K_M file's
    types -- repack through one kernel, their family's, of one signature: a cold run's first need is
    compiled once (the float32 and the int8 arrays are both passed, one pair empty)."""
    names = ("Q4_K", "Q6_K", "Q8_0", "Q5_0")
    assert max(gguf_blocks.KIND[n] for n in names) < gguf_blocks.gguf_lowbit.FIRST  # one family: gguf_first's
    for name in names:
        size, per, *_ = LAYOUTS[name]
        codes, scale, minimum, outer, seen = tiled_arrays(name, 8, 256)
        unpack_tiled(np.zeros((8, 256 // per * size), np.uint8), name, (8, 256), np.arange(8), 0, codes, scale,
                     minimum, seen, packed_width(name), outer)
    kernel = gguf_blocks.TILED_KERNELS[gguf_blocks.gguf_first.FIRST]
    scales = {tuple(a.dtype.name for a in sig[9:13]) for sig in kernel.signatures}
    assert scales == {("float32", "float32", "int8", "int8")}


# CI keeps Q4_K and IQ4_XS; the rest heavy (the suite's 30 minutes): Q2_K and Q3_K at their own bits are
# test_gguf_crumbs', Q6_K's 6-bit codes test_kernels' narrow codes, IQ3_S test_gguf_grid's
@pytest.mark.parametrize("name", [n if n in ("Q4_K", "IQ4_XS") else pytest.param(n, marks=pytest.mark.heavy)
                                  for n in TWO_LEVEL])
def test_k_quants_held_at_the_files_own_bits_give_the_numbers_of_whole_scales(name):
    """A K-quant packed as the file holds it (integer sub-block scales beside each block's d and
    -dmin) multiplies, on every path this CPU runs, and gathers rows to the bits the same codes give
    with float32 group scales, and takes the bytes the file takes plus 2 per 256 weights (Q3_K's 6-bit
    scales a byte each per 16; IQ4_XS its table's 4-bit indices)."""
    size, per, _, _, zero, affine = LAYOUTS[name]
    n, k = TILE + 9, 3 * 256
    raw = random_blocks(Q[name], n * k // per, seed=11 + len(name)).reshape(n, -1)
    bits, base = packed_width(name)
    nt = -(-n // TILE)
    codes, scale, minimum, outer, seen = tiled_arrays(name, n, k)
    unpack_tiled(raw, name, (n, k), np.arange(n), 0, codes, scale, minimum, seen, (bits, base), outer)
    two = PackedWeight.from_tiled(codes, (n, k), scale, minimum if affine else None, zero - base, bits,
                                  int(seen[:, 0].min()), int(seen[:, 1].max()), outer=outer)
    u, s, m, z, _ = unpack(raw, name, (n, k))
    u = INDEX[bits][u] if bits in INDEX else (u.astype(np.int32) - base).astype(np.uint8)  # a table's: indices
    whole = PackedWeight.from_codes(u, s, m, z - base, bits)
    assert two.scale.dtype == (torch.uint8 if name in JOINT else torch.int8) and whole.scale.dtype == torch.float32
    group = LAYOUTS[name][3]
    held = two.nbytes * 8 / (nt * TILE * k)  # int8 sub-block integers, d and -dmin per block:
    assert held <= layout_bits(bits) + 8 * (1 + affine) / group + 2 * 16 / per
    if name in ("Q4_K", "Q5_K", "Q6_K", "Q2_K"):  # codes and scales at the file's own width: its bytes + d and -dmin
        assert held <= 8 * size / per + 2 * 16 / 256
    for a, b in zip(two.group_values(), whole.group_values()):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    x = torch.randn(5, k)
    for path in ["float"] + [p for p in cpu.runnable_paths() if fits(p, two.width)]:
        for rows in (1, 2, 5):
            assert torch.equal(two.matmul(x[:rows], path), whole.matmul(x[:rows], path)), (path, rows)
    idx = torch.tensor([0, 5, n - 1])
    assert torch.equal(two.rows(idx), whole.rows(idx))
    assert torch.equal(two._rows_torch(idx), whole.rows(idx))


def test_a_large_matrix_unpacks_in_row_chunks_to_the_same_codes_and_keeps_no_file_pages(links, monkeypatch):
    """SmolLM2's tied embedding (Q8_0, 49,152 rows) unpacked a tile's rows at a time, each chunk's file
    pages dropped before the next is read, is the codes and scales of one whole pass; llama's
    permuted q rows go whole."""
    from larqlpy.model.families import read_config
    from larqlpy.weights import gguf_checkpoint
    from larqlpy.weights.gguf_checkpoint import GGUFCheckpoint

    f = GGUFFile(links["smol"])
    ckpt = GGUFCheckpoint(f, read_config(f.dir))
    codes = ckpt.native()
    whole = codes.pack(["model.embed_tokens.weight"])
    monkeypatch.setattr(gguf_checkpoint, "CHUNK_BYTES", 1)
    rows = np.arange(f.tensors["token_embd.weight"][1][0])
    assert len(codes._chunks("token_embd.weight", rows)) == -(-len(rows) // TILE)
    q = "blk.0.attn_q.weight"
    assert codes._chunks(q, f.arch.restore(q, np.arange(576), ckpt.raw_config)) == [(0, 576)]
    chunked = codes.pack(["model.embed_tokens.weight"])
    assert whole.meta() == chunked.meta() and torch.equal(whole.codes, chunked.codes)
    assert mapped_resident(ckpt.map) < f.tensors["token_embd.weight"][3] / 8  # the embedding's pages are gone
    assert all(torch.equal(a, b) for a, b in zip(whole.group_values(), chunked.group_values()) if a is not None)


def mapped_resident(m) -> int:
    """Bytes of the mapping `m` resident in this process (/proc/self/smaps)."""
    at = np.frombuffer(m, np.uint8).__array_interface__["data"][0]
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= at < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")
