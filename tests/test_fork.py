"""`n` choices from one prompt (state/branches.py): the prompt prefilled once and forked; growing exact
rows and codes shared (each branch stores only its own, and decodes the bits of a sequence that
never forked), rings copied, cells/v1 and no-cache prefilling per branch; every branch's ids those
of the same request run on its own seed beside the others."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from larqlpy.state.branches import Branches
from larqlpy.model.decoder import prefill
from larqlpy.engines import new_state
from larqlpy.engines.presets import SPREAD, option_texts
from larqlpy.engines.registry import parse_engine_spec
from larqlpy.engines.stores.rows import Rows
from larqlpy.errors import LarqlError
from larqlpy.kernels.kvcodec import tq_attend
from larqlpy.kernels.attention.decode import CHUNK
from larqlpy.pipeline.prepare import prepare_all
from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute, execute_many
from larqlpy.weights.loader import load
from test_structured import CITY
from tiny import make_tiny

ENGINES = [("canonical/v1", []), ("window/v1", []), ("codec/v1", ["bits=4"]), ("cells/v1", ["budget=8MiB"]),
           (None, [])]  # None: --engine no-cache


def base(long_text, engine, options, **kw) -> dict:
    where = {"engine": "no-cache"} if engine is None else {"continuation": engine, "options": options}
    return {"prompt": long_text[:700], "max_tokens": 4, "temperature": 0.8, **where, **kw}  # past one CHUNK


@pytest.mark.parametrize("engine, options", [  # codec/v1 heavy: the suite's 30-minute budget
    pytest.param(e, o, id=e or "no-cache", marks=pytest.mark.heavy if e == "codec/v1" else ()) for e, o in ENGINES])
def test_each_choice_is_the_request_on_its_own_seed(smol, long_text, engine, options):
    raw = base(long_text, engine, options)
    apart = dict(execute_many(smol, [(i, Request.from_dict({**raw, "seed": 7 + i})) for i in range(3)], parallel=3))
    many = execute(smol, Request.from_dict({**raw, "seed": 7, "n": 3}))
    assert [c["tokens"] for c in many["choices"]] == [apart[i]["tokens"] for i in range(3)]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2] and many["tokens"] == many["choices"][0]["tokens"]
    assert many["stats"]["completion_tokens"] == sum(len(c["tokens"]) for c in many["choices"])
    if engine == "canonical/v1":
        greedy = execute(smol, Request.from_dict({**raw, "temperature": 0, "n": 2}))
        assert greedy["choices"][0]["tokens"] == greedy["choices"][1]["tokens"]


def test_the_prompt_is_prefilled_once_and_its_rows_held_once(smol, long_text):
    seqs = prepare_all(smol, Request.from_dict(base(long_text, "canonical/v1", [], n=4)))
    for s in seqs:
        s.start()
    source = seqs[0].source
    assert isinstance(source, Branches) and source.taken == 4
    prompt = len(seqs[0].prompt_ids)
    parent = source.parent.state
    for s in seqs:
        assert s.ready and s.pending == 0 and s.held_from == 0  # nothing left to prefill; nothing was cached
        for mine, theirs in zip(s.state.layers, parent.layers):
            rows = mine.rows
            assert rows.offset == prompt // CHUNK * CHUNK > 0
            assert rows.prefix["k"].data_ptr() == theirs.rows.buf["k"].data_ptr()  # read in place, not copied
            own = rows.buf["k"].shape[1]
            assert own < CHUNK  # only the prompt's last partial chunk is the branch's own
            for field in ("k", "v"):
                assert torch.equal(rows.read(0, prompt)[field], theirs.rows.read(0, prompt)[field])
        assert s.state.resident_bytes() < parent.resident_bytes() / 4
    assert seqs[0].info["shared_prompt_kv_bytes"] == parent.resident_bytes()


FORKING = [p for p in SPREAD if not p[0].startswith("cells")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Gemma 3 (window 8: sliding layers are rings that wrap; every third layer global)."""
    root = tmp_path_factory.mktemp("fork")
    make_tiny(root, seed=0)
    return load(root, device="cpu", weights="int8", key_calibration=False).model


@pytest.mark.parametrize("preset", FORKING, ids=lambda p: p[0] + ":" + ",".join(option_texts(p)))
def test_a_branch_decodes_the_bits_of_a_sequence_that_never_forked(tiny, preset):
    spec = parse_engine_spec(None, preset[0], option_texts(preset))
    ids = [10 + i % 37 for i in range(300)]
    parent, plain, child = (new_state(spec, tiny.geometries(), tiny.device) for _ in range(3))
    prefill(tiny, parent, ids, 64)
    prefill(tiny, plain, ids, 64)
    child.fork_from(parent)
    for t in range(40, 60):  # decode steps on the branch (its own rows past the shared ones) and alone
        a, b = (tiny.forward(torch.tensor([t]), s)[-1] for s in (child, plain))
        assert torch.equal(a, b), f"step {t}"
    for mine, theirs, g in zip(child.layers, parent.layers, tiny.geometries()):
        rows = mine.main
        if rows.keep is None:  # a growing layer shares its prompt's rows (exact: up to a whole chunk)
            assert rows.offset >= 300 // CHUNK * CHUNK > 0 and mine.borrows()
            field = next(iter(rows.buf))
            assert rows.prefix[field].data_ptr() == theirs.main.buf[field].data_ptr()
            assert rows.end - rows.offset < CHUNK + 20 and mine.resident_bytes() < theirs.resident_bytes()
        else:
            assert rows.offset == 0 and g.window  # a sliding layer's ring is copied


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """The same at head size 64, which the codec's kernel scores and sums 16 rows at a time."""
    root = tmp_path_factory.mktemp("fork64")
    make_tiny(root, seed=0, head_dim=64, query_pre_attn_scalar=64)
    return load(root, device="cpu", weights="int8", key_calibration=False).model


@pytest.mark.parametrize("head_dim, preset", [  # codec/v1 at 16 heavy (the suite's 30 minutes): 64 is its kernel's
    pytest.param(h, p, id=f"{p[0]}:{','.join(option_texts(p))}-{h}",
                 marks=pytest.mark.heavy if h == 16 and p[0] == "codec/v1" else ()) for h in (16, 64) for p in FORKING])
def test_branches_stepped_together_decode_the_bits_of_sequences_that_never_forked(request, head_dim, preset,
                                                                                 monkeypatch):
    """Three branches of one prompt in one batch, each fed its own tokens: the stores that read the
    prompt's codes in place attend together (`LayerStore.attend_family`: codes/v1's one kernel call
    for the family, its rows in one stack) and every branch's logits are those of a sequence of its
    own, bit for bit -- through its recent tier's wrap, its own rows joining the main codes, and a
    branch leaving the family halfway. A branch in a stack holds the bytes of one stepped alone."""
    tiny = request.getfixturevalue("tiny" if head_dim == 16 else "tiny64")
    families = []
    real = tq_attend.attend_family
    monkeypatch.setattr(tq_attend, "attend_family", lambda *a: families.append(a[0].shape[0]) or real(*a))
    spec = parse_engine_spec(None, preset[0], option_texts(preset))
    ids = [10 + i % 37 for i in range(300)]
    parent = new_state(spec, tiny.geometries(), tiny.device)
    prefill(tiny, parent, ids, 64)
    plain = [new_state(spec, tiny.geometries(), tiny.device) for _ in range(3)]
    children = [new_state(spec, tiny.geometries(), tiny.device) for _ in range(4)]  # the last steps alone
    for state in plain:
        prefill(tiny, state, ids, 64)
    for child in children:
        child.fork_from(parent)
    together = any(s.family() is not None for s in children[0].layers)
    assert together == (preset[0] == "codec/v1")  # codes read in place by a fused kernel; not exact keys
    for t in range(24):
        b = 3 if t < 12 else 2
        tokens = [torch.tensor([40 + (t * (i + 1)) % 50]) for i in range(b)]
        got = tiny.forward_many([(tok, s, "last") for tok, s in zip(tokens, children)])
        want = tiny.forward_many([(tok, s, "last") for tok, s in zip(tokens, plain)])
        assert all(torch.equal(x, y) for x, y in zip(got, want)), f"step {t}"
        assert torch.equal(tiny.forward_many([(tokens[0], children[3], "last")])[0], got[0])
    assert bool(families) == together and sorted(set(families)) == ([2, 3] if together else [])
    assert children[0].resident_bytes() == children[3].resident_bytes()


def test_a_codec_branch_holds_only_its_own_codes(smol, long_text):
    seqs = prepare_all(smol, Request.from_dict(base(long_text, "codec/v1", ["bits=4"], n=4)))
    for s in seqs:
        s.start()
    parent = seqs[0].source.parent.state
    for s in seqs:
        assert all(mine.main.prefix is not None for mine in s.state.layers)
        assert s.state.resident_bytes() < parent.resident_bytes() / 4


def test_a_branch_trims_saves_and_restores_like_any_state():
    parent = Rows(2, {"k": ((4,), torch.float32)}, torch.device("cpu"))
    parent.append({"k": torch.randn(2, 300, 4)})
    child = Rows(2, {"k": ((4,), torch.float32)}, torch.device("cpu"))
    child.share(parent, 256)
    child.append({"k": torch.randn(2, 5, 4)})
    assert child.end == 305 and torch.equal(child.read(0, 300)["k"], parent.read(0, 300)["k"])
    assert torch.equal(child.read(250, 260)["k"], parent.read(250, 260)["k"])
    whole = child.read(0, 305)["k"]
    child.trim(280)
    assert child.end == 280 and torch.equal(child.read(0, 280)["k"], whole[:, :280])
    copy = Rows(2, {"k": ((4,), torch.float32)}, torch.device("cpu"))
    copy.restore(0, 280, [(0, child.read(0, 280))])
    assert copy.offset == 0 and torch.equal(copy.read(0, 280)["k"], whole[:, :280])


def test_a_grammar_holds_in_every_choice(smol):
    r = execute(smol, Request.from_dict({"messages": [{"role": "user", "content": "Name a city, in JSON."}],
                                         "json_schema": CITY, "max_tokens": 40, "temperature": 1.0, "seed": 3,
                                         "n": 3}))
    for c in r["choices"]:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["text"]), CITY)


def test_batch_lines_and_the_api_give_every_choice(smol, smol_dir):
    import larqlpy

    lines = [(0, Request.from_dict({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.9, "seed": 1,
                                    "n": 3})), (1, Request.from_dict({"prompt": "Hello", "max_tokens": 4}))]
    got = dict(execute_many(smol, lines, parallel=8))
    assert len(got[0]["choices"]) == 3 and "choices" not in got[1]
    m = larqlpy.load(smol_dir, device="cpu")
    reply = m.respond([{"role": "user", "content": "Say hi."}], n=2, max_tokens=8, temperature=0.9, seed=2)
    assert [c["index"] for c in reply["choices"]] == [0, 1] and reply["content"] == reply["choices"][0]["content"]
    with pytest.raises(LarqlError, match="ask `respond`"):
        m.complete("hi", n=2)


@pytest.mark.parametrize("raw, needle", [
    ({"n": 0}, "`n` must be in 1..16"), ({"n": 17}, "`n` must be in 1..16"), ({"n": "2"}, "`n` must be an integer"),
    ({"n": 2, "save_state": "x.lqkv"}, "cannot `save_state` or `resume`"),
])
def test_bad_n_is_refused_in_one_line(raw, needle, tmp_path):
    with pytest.raises(LarqlError, match=needle.replace("`", ".").replace("(", ".").replace(")", ".")):
        Request.from_dict({"prompt": "hi", **raw}).spec()
