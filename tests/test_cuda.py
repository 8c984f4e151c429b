"""The CUDA path, against the CPU and transformers: every family's logits, each engine, each weight
format (packed and a GGUF's own blocks), batching, the request pipeline (sampling, n, logprobs, a
grammar, a saved state), and speculative decoding. `make test-cuda` runs these on a GPU; without one
they are skipped with the reason. LARQLPY_TEST_DEVICE=cpu runs the same checks with the CPU in the
GPU's place (the comparisons then hold trivially: a check of the tests, not of CUDA)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from larqlpy.calibration import ensure as ensure_calibration
from larqlpy.config import GenerationConfig
from larqlpy.convert.native import SUPPORTED, decompose
from larqlpy.engines import EngineSpec, new_state, parse_engine_spec
from larqlpy.model.decoder import prefill
from larqlpy.kernels.weights.qweight import TILE, PackedWeight
from larqlpy.kernels.kvcodec.rowcodec import TurboQuantCodec
from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute
from larqlpy.weights.loader import load, load_with_draft
from test_batched import ENGINES, Job, alone, batched
from test_native import random_blocks
from tiny import FAMILIES, make_tiny, make_tiny_family

DEVICE = os.environ.get("LARQLPY_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="no CUDA device: `make test-cuda` runs these where one is")]

IDS = [2] + [7 + (i * 37) % 280 for i in range(40)]
# float32 on the GPU sums in other orders than the CPU (cuBLAS, SDPA): logits of magnitude ~25 move
# by ~1e-5; a wrong mask, position or scale moves them by whole units
BOUND = 1e-3
LONG = GenerationConfig(max_tokens=24, stop_at_eos=False, prefill_chunk=7)


def worst(a, b) -> float:
    return max(float((x.float().cpu() - y.float().cpu()).abs().max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    make_tiny(d)
    return d


@pytest.fixture(scope="module")
def pair(gemma_dir):
    """The tiny Gemma 3 on the CPU and on the GPU, each with a key calibration it measured itself."""
    both = load(gemma_dir, device="cpu"), load(gemma_dir, device=DEVICE)
    for loaded in both:
        ensure_calibration(loaded, ENGINES["codec"])
    return both


@pytest.mark.parametrize("family", ["gemma3"] + sorted(FAMILIES))
def test_every_family_on_the_gpu_matches_transformers(family, tmp_path):
    """Prefill over every position (the sliding windows crossed) and one step at a time after it."""
    hf = make_tiny(tmp_path) if family == "gemma3" else make_tiny_family(tmp_path, family)
    ours = load(tmp_path, device=DEVICE)
    assert ours.device.type == DEVICE and next(iter(ours.model.parameters())).device.type == DEVICE
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].float()
    state = new_state(EngineSpec(), ours.model.geometries(), ours.device)
    got = prefill(ours.model, state, IDS, 64, all_logits=True)
    assert got.device.type == DEVICE
    print(f"{family}: prefill {worst([got], [want]):.2e}")
    assert worst([got], [want]) < BOUND
    state = new_state(EngineSpec(), ours.model.geometries(), ours.device)
    prefill(ours.model, state, IDS[:20], 64)
    steps = torch.stack([ours.model(torch.tensor([t], device=ours.device), state)[-1] for t in IDS[20:]])
    print(f"{family}: steps {worst([steps], [want[20:]]):.2e}")
    assert worst([steps], [want[20:]]) < BOUND


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_engine_on_the_gpu_decodes_what_it_decodes_on_the_cpu(pair, engine):
    cpu, gpu = pair
    job = Job(IDS[:30], ENGINES[engine], LONG)
    (ci, cl), (gi, gl) = alone(cpu, job), alone(gpu, job)
    if engine != "codec":
        print(f"{engine}: {worst(cl, gl):.2e}")
        assert gi == ci and worst(cl, gl) < BOUND
        return
    # codes are a rounding of K/V: a sum in another order can move a value across a boundary, so
    # the GPU's codec is held to the CPU codec's own distance from the exact engine
    _, exact = alone(gpu, Job(IDS[:30], ENGINES["canonical"], LONG))
    _, exact_cpu = alone(cpu, Job(IDS[:30], ENGINES["canonical"], LONG))
    on_gpu, on_cpu = worst(gl, exact), worst(cl, exact_cpu)
    print(f"codec: gpu {on_gpu:.3f} cpu {on_cpu:.3f} apart {worst(cl, gl):.2e}")
    assert on_gpu <= 2 * on_cpu + BOUND


def test_window_is_bit_identical_to_canonical_on_the_gpu(pair):
    _, gpu = pair
    a = alone(gpu, Job(IDS[:30], ENGINES["canonical"], LONG))
    b = alone(gpu, Job(IDS[:30], ENGINES["window"], LONG))
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_codecs_torch_twin_on_the_gpu_writes_the_cpu_kernels_codes():
    x = torch.randn(257, 64, generator=torch.Generator().manual_seed(1))
    x[5] = 0.0  # a zero row: norm 0, no NaN
    for bits in (2, 3, 4, 5, 8):
        cpu, gpu = TurboQuantCodec(64, bits, torch.device("cpu")), TurboQuantCodec(64, bits, torch.device(DEVICE))
        a, b = cpu.encode(x), gpu.encode(x.to(DEVICE))
        same = (a["code"] == b["code"].cpu()).float().mean().item()
        print(f"tq{bits}: {same:.5f} of code bytes equal")
        assert same > 0.999 and torch.allclose(a["norm"], b["norm"].cpu(), rtol=1e-6)
        back = gpu.decode({k: v for k, v in a.items()} | {"code": a["code"].to(DEVICE), "norm": a["norm"].to(DEVICE)})
        assert back.device.type == DEVICE and worst([back], [cpu.decode(a)]) < 1e-5


def cpu_as_gpu(p: PackedWeight, always: bool = False) -> PackedWeight:
    """Off the CPU a packed matrix has no numba views; with the CPU standing in (or `always`), drop
    them so it takes the GPU's torch path (test_weights does the same)."""
    if DEVICE == "cpu" or always:
        p.arrays = ()
    return p


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_packed_weights_on_the_gpu(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(TILE * 2 + 3, 96, generator=g) * 0.05
    p = PackedWeight.quantize(w, fmt)
    dense = p.rows(torch.arange(w.shape[0]))
    on = cpu_as_gpu(p.to(torch.device(DEVICE)))
    for t in (1, 5):
        x = torch.randn(t, 96, generator=g)
        y = on.matmul(x.to(DEVICE))
        assert y.device.type == DEVICE and torch.allclose(y.cpu(), F.linear(x, dense), atol=1e-5, rtol=1e-4)
    idx = torch.tensor([[1, 2], [TILE + 1, 0]])
    assert torch.equal(on.rows(idx.to(DEVICE)).cpu(), dense[idx])


@pytest.mark.parametrize("name", SUPPORTED)
def test_a_ggufs_own_blocks_multiply_on_the_gpu(name):
    qtype = gguf.GGMLQuantizationType[name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = TILE + 6, 2 * 256 if block == 256 else 4 * 32
    data = random_blocks(qtype, n * k // block, seed=len(name)).reshape(n, -1)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(n, k))
    on = cpu_as_gpu(PackedWeight.from_codes(*decompose(data, qtype, (n, k))).to(torch.device(DEVICE)))
    assert torch.equal(on.rows(torch.arange(n, device=DEVICE)).cpu(), want)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(on.matmul(x.to(DEVICE)).cpu(), F.linear(x, want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_each_weight_format_decodes_on_the_gpu_as_on_the_cpu(gemma_dir, weights):
    """Against the CPU's torch twins: the CPU's int8/int4 kernels quantize activations to 8 bits
    (as llama.cpp's do), which the GPU's float products do not."""
    cpu, gpu = load(gemma_dir, device="cpu", weights=weights), load(gemma_dir, device=DEVICE, weights=weights)
    for loaded, always in ((cpu, True), (gpu, False)):
        for module in loaded.model.modules():
            for w in vars(module).values():
                if isinstance(getattr(w, "whole", w), PackedWeight):
                    cpu_as_gpu(getattr(w, "whole", w), always)
    job = Job(IDS[:30], ENGINES["window"], LONG)
    (ci, cl), (gi, gl) = alone(cpu, job), alone(gpu, job)
    print(f"{weights}: {worst(cl, gl):.2e}")
    assert gi == ci and worst(cl, gl) < BOUND


def test_bfloat16_activations_on_the_gpu_stay_near_float32(gemma_dir):
    f32, bf16 = load(gemma_dir, device=DEVICE), load(gemma_dir, device=DEVICE, dtype="bfloat16")
    a = prefill(f32.model, new_state(EngineSpec(), f32.model.geometries(), f32.device), IDS, 64, all_logits=True)
    b = prefill(bf16.model, new_state(EngineSpec(), bf16.model.geometries(), bf16.device), IDS, 64, all_logits=True)
    cos = F.cosine_similarity(a.float(), b.float(), dim=-1).min().item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"bf16: min cosine {cos:.5f}, top-1 agreement {agree:.3f}")
    assert cos > 0.995 and agree > 0.9


def test_a_batch_of_every_engine_on_the_gpu_gives_each_sequence_its_own_ids(pair):
    _, gpu = pair
    prompts = [IDS[:12], IDS[3:5], IDS[:25], IDS[10:19], IDS[1:30]]
    jobs = [Job(p, ENGINES[e], LONG, key=e) for p, e in zip(prompts, sorted(ENGINES))]
    got = batched(gpu, jobs, parallel=3)
    for job in jobs:
        ids, logits = alone(gpu, job)
        apart = worst(got[job.key][1], logits)
        print(f"batched {job.key}: {apart:.2e}")
        if job.key != "codec":
            assert got[job.key][0] == ids and apart < BOUND
            continue
        # a batch's GEMM rounds otherwise than one row's GEMV: a K/V code can flip (test_batched)
        exact = alone(gpu, job._replace(spec=ENGINES["canonical"]))[1]
        assert apart <= 2 * worst(logits, exact) + BOUND


def req(**kw) -> Request:
    return Request.from_api(IDS[:12], **{"max_tokens": 12, **kw})


def test_the_request_pipeline_on_the_gpu(pair):
    """Seeded sampling repeats; n choices fork one prefill; logprobs; the same greedy ids as the CPU."""
    cpu, gpu = pair
    assert execute(gpu, req())["tokens"] == execute(cpu, req())["tokens"]
    a, b = (execute(gpu, req(temperature=0.9, top_p=0.9, seed=5)) for _ in range(2))
    assert a["tokens"] == b["tokens"]
    many = execute(gpu, req(temperature=1.0, seed=3, n=3))
    assert len(many["choices"]) == 3
    lp = execute(gpu, req(logprobs=3))
    entries = lp["logprobs"]
    assert len(entries) == len(lp["tokens"])
    assert all(e["logprob"] <= 0.0 and len(e["top_logprobs"]) == 3 for e in entries)


def test_a_grammar_and_the_penalties_hold_on_the_gpu(pair):
    cpu, gpu = pair
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"],
              "additionalProperties": False}
    out = execute(gpu, req(json_schema=schema, max_tokens=40, temperature=1.0, seed=1))
    assert json.loads(out["text"])["a"] in ("x", "yy")
    shaped = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.3, logit_bias={217: -100})
    a, b = execute(gpu, req(**shaped)), execute(cpu, req(**shaped))
    assert a["tokens"] == b["tokens"] and 217 not in a["tokens"]


def test_a_state_saved_on_the_gpu_resumes_there(pair, tmp_path):
    _, gpu = pair
    whole = execute(gpu, req(max_tokens=10))
    execute(gpu, req(max_tokens=4, save_state=str(tmp_path / "s.lqkv")))
    more = execute(gpu, Request.from_api("", resume=str(tmp_path / "s.lqkv"), max_tokens=6))
    assert whole["tokens"][4:] == more["tokens"]


def test_speculative_decoding_on_the_gpu_gives_the_targets_ids(tmp_path):
    make_tiny(tmp_path / "target", seed=0)
    make_tiny(tmp_path / "draft", seed=1, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    both = load_with_draft(tmp_path / "target", draft=tmp_path / "draft", device=DEVICE)
    alone_ = load(tmp_path / "target", device=DEVICE)
    for spec in ("canonical/v1", "window/v1"):
        a = execute(both, req(max_tokens=20, continuation=spec, draft_tokens=4, draft_p_min=0.0))
        b = execute(alone_, req(max_tokens=20, continuation=spec))
        assert a["tokens"] == b["tokens"]


def test_window_engine_past_the_window_on_the_gpu_holds_fewer_rows(pair):
    _, gpu = pair
    canon = new_state(EngineSpec(), gpu.model.geometries(), gpu.device)
    win = new_state(parse_engine_spec(continuation="window/v1"), gpu.model.geometries(), gpu.device)
    for s in (canon, win):
        prefill(gpu.model, s, IDS, 8)
    assert win.retained_rows() < canon.retained_rows() and win.resident_bytes() < canon.resident_bytes()
