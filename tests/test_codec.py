"""codec/v1: the codebooks, the numba and torch kernels, the engines, and their accuracy on real rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from larqlpy.engines import new_state, parse_engine_spec
from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.base import AttentionParams
from larqlpy.engines.stores.state import Scratch
from larqlpy.engines.stores.calibration import NO_CALIBRATION
from larqlpy.engines.stores.codec import CodecStore
from larqlpy.engines.stores.kvcodec import KVCodec
from larqlpy.errors import LarqlError
from larqlpy.kernels.kvcodec import codebooks, tq_step
from larqlpy.kernels.kvcodec.lloyd_max import gaussian_codebook
from larqlpy.kernels.kvcodec.rowcodec import Int4GroupCodec, TurboQuantCodec
from larqlpy.kernels.kvcodec.turboquant_torch import TorchCodec
from larqlpy.weights.loader import load
from tiny import make_tiny

CPU = torch.device("cpu")


def test_codebooks_are_lloyd_max_for_the_normal():
    for bits, known in ((3, 0.0345), (4, 0.0095)):
        c, b, mse = gaussian_codebook(bits)
        assert abs(mse - known) < 1e-4, (bits, mse)
        assert np.allclose(c, codebooks.CENTROIDS[bits], atol=1e-12)
        assert np.allclose(c, -c[::-1]) and np.allclose(b, (c[1:] + c[:-1]) / 2)
    # empirical MSE per coordinate of the whole codec on random directions matches the codebook's
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    for bits, mse in ((3, 0.0345), (4, 0.0095)):
        codec = TurboQuantCodec(256, bits, CPU)
        err = (codec.decode(codec.encode(x)) - x) / x.norm(dim=-1, keepdim=True)
        assert abs(err.pow(2).sum(-1).mean().item() - mse) < 0.1 * mse


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("d", [64, 256])
def test_numba_and_torch_give_the_same_codes_and_values(bits, d):
    x = torch.randn(1000, d, generator=torch.Generator().manual_seed(bits * d)) * 5
    x[3] = 0.0  # a zero row must not produce NaNs
    numba_codec, torch_codec = TurboQuantCodec(d, bits, CPU), TorchCodec(d, bits, CPU)
    a = numba_codec.encode(x)
    norms, codes = torch_codec.encode(x)
    assert torch.equal(a["norm"], norms) and torch.equal(a["code"], codes)
    assert torch.equal(numba_codec.decode(a), torch_codec.decode(norms, codes))
    assert torch.equal(numba_codec.decode(a)[3], torch.zeros(d))
    assert a["code"].shape == (1000, d * bits // 8)


def test_packing_layout():
    idx = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0] * 2])
    c3 = TorchCodec(16, 3, CPU).pack(idx)
    word = sum(v << (3 * k) for k, v in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert c3.tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16] * 2]  # eight per three bytes
    c4 = TorchCodec(16, 4, CPU).pack(torch.tensor([[1, 15, 2, 14, 0, 0, 9, 3] * 2]))
    assert c4.tolist()[0][:4] == [0xF1, 0xE2, 0x00, 0x39]  # two per byte, low nibble first
    codec = TorchCodec(16, 3, CPU)
    assert torch.equal(codec.unpack_values(c3), codec.centroids[idx])


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_attending_on_codes_equals_decoding_them(d):
    """The fused kernel (16 rows at a time for head sizes 64, 128 and 256, one at a time for others)
    against decoding the codes and attending on them, through blocks of 16 and a short last one."""
    g = LayerGeometry(0, None, 2, d)
    codec = TurboQuantCodec(d, 4, CPU)
    fused = CodecStore(g, CPU, codec=KVCodec(codec, codec), keep=None, scratch=Scratch(CPU))
    plain = CodecStore(g, CPU, codec=KVCodec(codec, codec), keep=None, scratch=Scratch(CPU), fused=False)
    p = AttentionParams(scale=d ** -0.5)
    gen = torch.Generator().manual_seed(1)
    for t in (5, 1, 1, 3, 1, 40, 1, 1):
        q, k, v = (torch.randn(h, t, d, generator=gen) for h in (4, 2, 2))
        a = fused.attend(q, k, v, p)
        b = plain.attend(q, k, v, p)  # the decode-to-scratch path
        assert (a - b).abs().max().item() < 1e-4


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_a_decode_steps_codes_written_in_place_equal_a_blocks(bits):
    """Decode steps encode their row straight into the store's buffers (tq_step.append_step, one
    call for K and V and every code set); a prefill block encodes many rows in parallel chunks
    (`encode`). A speculative verification and a resumed state mix the two, so they must give the
    same bytes."""
    codec, wide = TurboQuantCodec(64, bits, CPU), TurboQuantCodec(64, 8, CPU)
    x = torch.randn(300, 2, 64, generator=torch.Generator().manual_seed(bits)) * 3
    x[7, 1] = 0.0
    v = x.flip(0).contiguous()
    sets = []
    for c in (codec, wide):
        nbytes = c.fields["code"][0][0]
        bufs = [np.zeros((2, 300, nbytes)[:n], t) for _ in "kv" for n, t in ((2, np.float32), (3, np.uint8))]
        sets.append((c.boundaries, c.bits, c.boundaries, c.bits, *bufs))
    for r in range(300):
        tq_step.append_step(x[r, :, None].numpy(), v[r, :, None].numpy(), NO_CALIBRATION, codec.signs, tuple(sets),
                            (r, 299 - r))
    for c, got, order in ((codec, sets[0], slice(None)), (wide, sets[1], slice(None, None, -1))):
        for rows, (norms, codes) in ((x, got[4:6]), (v, got[6:8])):
            block = c.encode(rows.reshape(-1, 64))
            assert np.array_equal(norms[:, order].T.reshape(-1), block["norm"].numpy())
            assert np.array_equal(codes[:, order].transpose(1, 0, 2).reshape(600, -1), block["code"].numpy())


def test_a_wrapped_ring_is_read_in_place_as_two_runs():
    """Decode steps read a ring's rows where they lie (no copy): the run that ends at the buffer's
    end, then the one from its start; the same rows `read` gives in order."""
    g = LayerGeometry(0, 6, 2, 64)
    codec = TurboQuantCodec(64, 4, CPU)
    store = CodecStore(g, CPU, codec=KVCodec(codec, codec), keep=6, scratch=Scratch(CPU))
    gen = torch.Generator().manual_seed(5)
    for t in (4, 1, 1, 1, 1):
        q, k, v = (torch.randn(h, t, 64, generator=gen) for h in (4, 2, 2))
        store.attend(q, k, v, AttentionParams(scale=0.125))
    rows = store.rows
    spans = rows.spans(rows.base, rows.end)
    assert [(first, n) for _, first, n in spans] == [(2, 4), (0, 2)]
    assert all(fields["k_code"] is rows.buf["k_code"] for fields, _, _ in spans)
    want = rows.read(rows.base, rows.end)
    for name in want:
        got = torch.cat([fields[name][:, first:first + n] for fields, first, n in spans], dim=1)
        assert torch.equal(got, want[name])


def test_recent_rows_write_the_bytes_codec_writes():
    g = LayerGeometry(0, 6, 1, 64)
    codec = TurboQuantCodec(64, 3, CPU)
    plain = CodecStore(g, CPU, codec=KVCodec(codec, codec), keep=6, scratch=Scratch(CPU))
    recent = CodecStore(g, CPU, codec=KVCodec(codec, codec), keep=6, scratch=Scratch(CPU), exact_keys=4)
    p = AttentionParams(scale=0.125)
    gen = torch.Generator().manual_seed(2)
    for t in (3, 1, 1, 4, 1, 1, 1):
        q, k, v = (torch.randn(h, t, 64, generator=gen) for h in (4, 1, 1))
        plain.attend(q, k, v, p)
        recent.attend(q, k, v, p)
        assert (recent.exact_keys.base, recent.exact_keys.end) == (max(0, recent.end - 4), recent.end)
    a, b = plain.rows.read(*plain.retained()), recent.rows.read(*recent.retained())
    assert all(torch.equal(a[name], b[name]) for name in a)
    k_read, _ = recent.read(recent.end - 6, torch.float32)
    exact = recent.exact_keys.read(recent.end - 4, recent.end)["k"]
    assert torch.equal(k_read[:, -4:], exact)  # the newest k K rows come back exact


def test_head_dim_must_be_a_power_of_two(tmp_path):
    make_tiny(tmp_path, head_dim=12, query_pre_attn_scalar=12)
    loaded = load(tmp_path)
    for spec in (parse_engine_spec(continuation="codec/v1", options=["bits=4"]),
                 parse_engine_spec(engine="turbo-quant:bits=3")):
        with pytest.raises(LarqlError, match="head_dim 12 is not a power of two"):
            new_state(spec, loaded.model.geometries(), loaded.device)


def test_int4_group_codec():
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(3))
    codec = Int4GroupCodec(256, 32, CPU)
    f = codec.encode(x)
    assert f["scale"].dtype == torch.float16 and f["scale"].shape == (300, 8) and f["code"].shape == (300, 128)
    assert codec.row_bytes == 8 * 2 + 128  # 4.5 bits per value
    y = codec.decode(f)
    step = f["scale"].float().repeat_interleave(32, dim=1) / 7
    assert ((y - x).abs() <= step / 2 + 1e-3).all()  # round-to-nearest on each group's grid


@pytest.fixture(scope="module")
def real_rows(real, long_text):
    """K and V rows of every layer of the 270M over 1,024 real positions (canonical run)."""
    ids = real.tokenizer.encode(long_text)[:1024]
    state = new_state(parse_engine_spec(), real.model.geometries(), real.device)
    real.model(torch.tensor(ids), state)
    return [s.read(0, torch.float32) for s in state.layers]


@pytest.mark.parametrize("bits, floor", [(4, 0.995), (3, 0.982)])
def test_per_row_cosine_on_real_rows(real_rows, bits, floor):
    codec = TurboQuantCodec(256, bits, CPU)
    for layer, (k, v) in enumerate(real_rows):
        for x in (k[0], v[0]):
            y = codec.decode(codec.encode(x))
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
            assert cos.mean().item() >= floor, (layer, cos.mean().item())


PLAIN = ["calib=off", "sink=0", "recent=0"]  # LARQL's codec: codes alone


@pytest.mark.parametrize("spec_args, bits", [(("codec/v1", ["bits=4", *PLAIN]), 4),
                                             (("codec/v1", ["bits=3", *PLAIN]), 3)])
def test_resident_bytes_follow_the_formula(real, long_text, spec_args, bits):
    spec = parse_engine_spec(continuation=spec_args[0], options=spec_args[1])
    state = new_state(spec, real.model.geometries(), real.device)
    ids = real.tokenizer.encode(long_text)[:700]
    real.model(torch.tensor(ids[:600]), state)
    for t in ids[600:610]:
        real.model(torch.tensor([t]), state)
    per_row = 2 * 1 * (4 + 256 * bits // 8)
    by_kind = state.resident_by_kind()
    assert by_kind["sliding"] == 15 * 512 * per_row  # exactly the rings of codes
    assert 3 * 610 * per_row <= by_kind["global"] <= 2 * 3 * 610 * per_row
    assert by_kind["scratch"] == 0  # freed after every block (decode steps attend on codes)
    state.layers[5].read(0, torch.float32)  # a read decodes one layer into it ...
    assert 0 < state.resident_by_kind()["scratch"] <= 2 * 1 * 610 * 256 * 4  # ... bounded by that layer


def test_codec_tracks_canonical_on_270m(real):
    """Teacher-forced next-token drift against canonical/v1 over 32 steps (the docs' table runs 256)."""
    from larqlpy.tools.quality import drift

    ids = real.tokenizer.encode("The history of the printing press begins in")
    window, ref = drift(real.model, parse_engine_spec(continuation="window/v1"), ids, 32)
    assert window.mean_kl == 0.0 and window.top1 == 1.0 and window.common_prefix == 32
    four, _ = drift(real.model, parse_engine_spec(continuation="codec/v1", options=["bits=4", *PLAIN]), ids, 32, ref)
    three, _ = drift(real.model, parse_engine_spec(continuation="codec/v1", options=["bits=3", *PLAIN]), ids, 32, ref)
    recent, _ = drift(real.model, parse_engine_spec(continuation="codec-recent/v1",
                                                    options=["bits=4", "exact_recent_k=64"]), ids, 32, ref)
    assert 0 < four.mean_kl < 0.2 and four.top1 >= 0.7
    assert four.mean_kl < three.mean_kl < 0.6
    assert recent.mean_kl < four.mean_kl / 4  # exact recent keys recover most of the loss
