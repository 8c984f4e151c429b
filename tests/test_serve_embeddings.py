"""Embeddings (/v1/embeddings through `larqlpy serve` and the official openai client, and
`Model.embed`): the final hidden state pooled (last token or mean) and normalized, against
transformers' AutoModel on the same directory -- one text alone, texts of different lengths batched
together, an input longer than a prefill chunk, embeddings beside a generating sequence in one
scheduler -- and the answer's forms (float, base64, token ids), its usage and its refusals."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from larqlpy.api.model import Model
from larqlpy.config import GenerationConfig
from larqlpy.decode.scheduler import Scheduler
from larqlpy.decode.sequence import Sequence
from larqlpy.decode.stream import stream_generate
from larqlpy.engines import EngineSpec
from larqlpy.pipeline.embed import embeddings
from serving import Server

NAME = "smollm2-135m-instruct"
TEXTS = ["The cat sat on the mat.", "hi", "How do I reverse a list in Python? I tried slicing but it made a copy "
         "and I want to do it in place, without a second list.", "Paris is the capital of France."]
TOL = 1e-4  # max abs difference from transformers (measured: ~2e-6 in float32)


@pytest.fixture(scope="module")
def server(smol_dir):
    with Server(smol_dir, "--parallel", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def hf(path):
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def hf_smol(smol_dir):
    return hf(smol_dir)


def reference(model, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' base model: the same pooling over last_hidden_state, L2-normalized."""
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0)


def assert_matches(ref, texts, got, pooling) -> None:
    """`got` (one vector per text) against transformers, its own tokenizer's ids included."""
    model, tokenizer = ref
    assert len(got) == len(texts)
    for text, vec in zip(texts, got):
        want = reference(model, tokenizer(text)["input_ids"], pooling)
        diff = (torch.as_tensor(np.asarray(vec, dtype=np.float32)) - want).abs().max().item()
        assert diff < TOL, (pooling, text, diff)


def body(inp, **kw) -> dict:
    return {"model": NAME, "input": inp, **kw}


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_served_embeddings_equal_transformers_alone_and_batched(client, hf_smol, pooling):
    pick = {"extra_body": {"larqlpy": {"pooling": pooling}}} if pooling != "last" else {}  # "last": the default
    one = client.embeddings.create(model=NAME, input=TEXTS[2], **pick)
    assert_matches(hf_smol, TEXTS[2:3], [one.data[0].embedding], pooling)
    many = client.embeddings.create(model=NAME, input=TEXTS, **pick)  # the client asks for base64
    assert [d.index for d in many.data] == list(range(len(TEXTS))) and many.model == NAME
    assert_matches(hf_smol, TEXTS, [d.embedding for d in many.data], pooling)


def test_float_base64_and_token_ids_agree_and_usage_counts(server, hf_smol):
    ids = [hf_smol[1](t)["input_ids"] for t in TEXTS[:2]]
    counted = server.metrics().get('larqlpy_tokens_total{kind="prompt"}', 0)
    floats = server.post("/v1/embeddings", body(TEXTS[:2], user="u1", dimensions=576)).json()
    assert server.metrics()['larqlpy_tokens_total{kind="prompt"}'] - counted == sum(map(len, ids))
    coded = server.post("/v1/embeddings", body(TEXTS[:2], encoding_format="base64")).json()
    as_ids = server.post("/v1/embeddings", body(ids)).json()
    one_ids = server.post("/v1/embeddings", body(ids[0])).json()
    for f, c, i in zip(floats["data"], coded["data"], as_ids["data"]):
        assert f["object"] == "embedding" and len(f["embedding"]) == 576
        # two requests, two computations, which the server may batch (as texts arrive) or thread (as
        # the load is) apart: a clean-clone CI saw them 1e-7 apart once; a wrong encoding is far off
        assert np.allclose(np.frombuffer(base64.b64decode(c["embedding"]), dtype="<f4"),
                           np.asarray(f["embedding"], dtype=np.float32), rtol=0, atol=1e-6)
        assert np.allclose(f["embedding"], i["embedding"], atol=1e-6)
    assert np.allclose(one_ids["data"][0]["embedding"], floats["data"][0]["embedding"], atol=1e-6)
    n = sum(map(len, ids))
    assert floats["object"] == "list" and floats["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert one_ids["usage"]["prompt_tokens"] == len(ids[0])


@pytest.mark.parametrize("fields, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"), ({"input": [1.5]}, "input"), ({"input": {"a": 1}}, "input"),
    ({"input": [[1, 10 ** 9]]}, "input"), ({"input": [1] * 8193}, "input"), ({"input": ["a"] * 65}, "input"),
    ({"input": "a", "dimensions": 64}, "dimensions"), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "larqlpy": {"pooling": "max"}}, "pooling"), ({"input": "a", "larqlpy": {"engine": "x"}}, "larqlpy"),
    ({"input": "a", "user": 3}, "user")])
def test_bad_input_is_a_400_in_openai_shape(server, fields, param):
    r = server.post("/v1/embeddings", {"model": NAME, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and "\n" not in error["message"]


def test_refusals_through_the_client(client, server):
    with pytest.raises(openai.BadRequestError, match="576 dimensions"):
        client.embeddings.create(model=NAME, input="a", dimensions=256)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="a")
    assert server.post("/v1/embeddings", {"model": NAME, "input": "a"}).status_code == 200  # still serving


def test_embeddings_beside_generation_in_one_scheduler(smol, hf_smol):
    """Mixed steps: a generating sequence's logits and embeddings' hidden rows from one forward pass;
    inputs longer than a prefill chunk pool across their chunks."""
    gen = GenerationConfig(max_tokens=8, stop_at_eos=False)
    prompt = smol.tokenizer.encode("Once upon a time")
    alone = [t.id for t in stream_generate(smol.model, prompt, EngineSpec(), gen)]
    for pooling in ("last", "mean"):
        seq = Sequence(smol.model, prompt, EngineSpec(), gen)
        embeds = embeddings(smol, TEXTS, pooling, prefill_chunk=8)
        assert len(embeds[2].prompt_ids) > 3 * 8
        for _ in Scheduler(smol.model, 4).run([seq, *embeds]):
            pass
        assert seq.generated == alone and all(e.error is None for e in embeds)
        assert_matches(hf_smol, TEXTS, [e.vector for e in embeds], pooling)


@pytest.mark.parametrize("which", ["qwen", "real"])
def test_model_embed_equals_transformers(request, which):
    """Model.embed on Qwen2.5-Coder-0.5B and Gemma 3 270M: one text (a vector), and a batch (rows)."""
    loaded = request.getfixturevalue(which)
    ref = hf(loaded.path)
    model = Model(loaded)
    for pooling in ("last", "mean"):
        one = model.embed(TEXTS[0], pooling=pooling)
        assert one.shape == (loaded.config.hidden_size,)
        assert_matches(ref, TEXTS[:1], [one], pooling)
        assert_matches(ref, TEXTS, model.embed(TEXTS, pooling=pooling), pooling)
    ids = ref[1](TEXTS[3])["input_ids"]
    assert torch.allclose(model.embed(ids), model.embed([TEXTS[3]])[0], atol=1e-6)


@pytest.mark.heavy  # the Qwen check again, through the GGUF loader (its matrices dequantized: the directory's floats)
def test_gguf_embed_equals_transformers_on_the_same_directory(qwen_dir):
    import larqlpy
    from larqlpy.convert.parts import QWEN_CODER_05B, assemble

    model = larqlpy.load(assemble(QWEN_CODER_05B, qwen_dir.parent / "gguf"), weights="f32")
    ref = hf(qwen_dir)
    for pooling in ("last", "mean"):
        assert_matches(ref, TEXTS, model.embed(TEXTS, pooling=pooling), pooling)


def test_serve_refuses_a_bad_pooling_in_one_line(cli, smol_dir):
    code, _, err = cli("serve", smol_dir, "--pooling", "max")
    assert code == 2 and err.strip() == "larqlpy: error: --pooling must be one of last, mean, got 'max'"
