"""Stop strings in the decode loop: cut where the text first holds one, across token boundaries, the
same in every entry point, and the state kept after a stop ends where the text ends."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from larqlpy.decode.stops import Piece, StopStrings

ALPHABET = "ab, \n"


def through(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[Piece], bool, list[int]]:
    """Every piece pushed in order; (what went out, whether a stop string cut it, how many pieces had
    been pushed when each went out)."""
    s = StopStrings(stops)
    out, when = [], []
    for i, text in enumerate(pieces):
        got = s.push(Piece(i, text))
        out += got
        when += [i + 1] * len(got)
        if s.cut:
            return out, True, when
    rest = s.flush()  # cuts where a stop string waited on an earlier one that never completed
    return out + rest, s.cut, when + [len(pieces)] * len(rest)


def test_a_stop_string_waits_for_one_that_begins_earlier():
    """'b' appears first, but '\nba' began before it and may still complete: it decides the cut;
    where it does not complete, 'b' does, when the sequence ends."""
    assert "".join(p.text for p in through(["\n", "b", "a"], ("b", "\nba"))[0]) == ""
    out, cut, _ = through(["\n", "b"], ("b", "\nba"))
    assert "".join(p.text for p in out) == "\n" and cut
    out, cut, _ = through(["\n", "b", "c"], ("b", "\nba"))
    assert "".join(p.text for p in out) == "\n" and cut


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(ALPHABET, max_size=4), min_size=1, max_size=12),
       st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3))
def test_the_text_ends_before_the_first_stop_string(pieces, stops):
    out, cut, when = through(pieces, tuple(stops))
    text = "".join(p.text for p in out)
    whole = "".join(pieces)
    first = min((i for i in (whole.find(s) for s in stops) if i >= 0), default=-1)
    assert text == (whole if first < 0 else whole[:first])
    assert cut == (first >= 0)
    ids = [p.id for p in out]
    assert ids == list(range(len(ids)))  # a prefix of the tokens, in order
    for p in out[:-1]:
        assert p.text == pieces[p.id]  # only the last may be shortened
    if cut and out:  # the last token kept is the one the text ends in: the cut falls inside it or at its end
        start = sum(len(pieces[i]) for i in range(out[-1].id))
        assert start < first <= start + len(pieces[out[-1].id]) or (first == start and not pieces[out[-1].id])
    # a token goes out only once a later one has come (so the last one out carries the finish)
    assert all(w > p.id + 1 or w == len(pieces) or cut for p, w in zip(out, when))


def test_a_stop_string_across_three_tokens_drops_them_and_keeps_the_one_before():
    out, cut, _ = through(["Hello", "\n", "\nUs", "er", ": more"], ("\n\nUser:",))
    assert cut and [p.text for p in out] == ["Hello"] and [p.id for p in out] == [0]


def test_a_stop_string_inside_one_token_shortens_it():
    out, cut, _ = through(["one", " two,", " three"], (",",))
    assert cut and [p.text for p in out] == ["one", " two"]


def test_without_stop_strings_every_token_goes_out_at_once():
    s = StopStrings(())
    assert [p.text for p in s.push(Piece(0, "a"))] == ["a"] and s.flush() == []


def test_text_that_could_begin_a_stop_string_waits():
    s = StopStrings(("User:",))
    assert s.push(Piece(0, "Hi ")) == []  # the newest always waits
    assert [p.text for p in s.push(Piece(1, "there "))] == ["Hi "]
    assert s.push(Piece(2, "Us")) == []  # "Us" could begin "User:", and "there " would then end the text
    assert s.push(Piece(3, "e")) == []
    assert [p.text for p in s.push(Piece(4, "d it"))] == ["there ", "Us", "e"]


# -- every entry point, on SmolLM2 ----------------------------------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from serving import ENV, EXE, Server  # noqa: E402

PROMPT = "The three primary colors are"
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol8(smol_dir):
    from larqlpy.weights.loader import load

    return load(smol_dir, device="cpu", weights="int8")


@pytest.fixture(scope="module")
def across(smol8):
    """A stop string that starts inside one generated token and ends inside the next: (the tokens
    without it, the string, the text before it, how many tokens the text ends in)."""
    from larqlpy.api.model import Model

    toks = list(Model(smol8).generate(PROMPT, max_tokens=24, stop_at_eos=False))
    text = "".join(t.text for t in toks)
    for i in range(1, len(toks) - 1):
        a, b = toks[i].text, toks[i + 1].text
        stop = a[-2:] + b[:2]
        at = len("".join(t.text for t in toks[:i + 1])) - 2
        if len(a) >= 3 and len(b) >= 2 and text.find(stop) == at:
            return toks, stop, text[:at], i + 1
    pytest.fail(f"no two neighbouring tokens to cut across in {text!r}")


def cli(*args):
    r = subprocess.run([*EXE, *map(str, args)], capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


def same_state(a, b) -> bool:
    from larqlpy.state.format import load_state

    x, y = load_state(a), load_state(b)
    if x.tokens != y.tokens or x.processed != y.processed:
        return False
    for layer in y.records:
        for (ma, fa), (mb, fb) in zip(x.records[layer], y.records[layer]):
            strip = {k: v for k, v in ma.items() if k != "_where"}  # where in its own file the data lies
            if strip != {k: v for k, v in mb.items() if k != "_where"} or \
                    not all(np.array_equal(fa[k], fb[k]) for k in fb):
                return False
    return True


def test_a_stop_string_across_tokens_gives_one_text_and_one_kept_state_everywhere(smol8, smol_dir, across, tmp_path):
    from larqlpy.api.model import Model
    from larqlpy.state.format import load_state

    toks, stop, want, kept = across
    prompt_ids = smol8.tokenizer.encode(PROMPT)
    api = list(Model(smol8).generate(PROMPT, max_tokens=24, stop_at_eos=False, stop=[stop]))
    assert "".join(t.text for t in api) == want and api[-1].finish_reason == "stop"
    assert [t.id for t in api] == [t.id for t in toks[:kept]]  # the token the text ends in is the last

    run = json.loads(cli("run", smol_dir, PROMPT, "-n", 24, "--weights", "int8", "--stop", stop, "--stop", "never here",
                         "--json", "--save-state", tmp_path / "run.lqkv"))
    assert run["text"] == want and run["finish_reason"] == "stop" and run["tokens"] == [t.id for t in api]
    saved = load_state(tmp_path / "run.lqkv")
    assert saved.tokens == prompt_ids + run["tokens"] and saved.processed == len(saved.tokens) - 1

    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"prompt": PROMPT, "max_tokens": 24, "stop": stop,
                                 "save_state": str(tmp_path / "batch.lqkv")}) + "\n")
    rec = json.loads(cli("batch", smol_dir, lines, "--weights", "int8", "--quiet"))
    assert rec["text"] == want and rec["tokens"] == run["tokens"] and rec["finish_reason"] == "stop"
    assert same_state(tmp_path / "run.lqkv", tmp_path / "batch.lqkv")

    with Server(smol_dir, "--weights", "int8", "--state-dir", str(tmp_path / "kept")) as s:
        r = s.post("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                       "stop": [stop]}).json()
        streamed = []
        with s.stream("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                          "stop": stop, "stream": True}) as lines_:
            for line in lines_:
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0])
    assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
    assert r["larqlpy"]["tokens"] == run["tokens"]
    assert "".join(c["text"] for c in streamed) == want and streamed[-1]["finish_reason"] == "stop"
    kept_files = sorted((tmp_path / "kept").glob("*.lqkv"))
    assert kept_files and all(same_state(tmp_path / "run.lqkv", f) for f in kept_files)


def test_a_state_kept_after_a_stop_resumes_exactly(smol8, smol_dir, across, tmp_path):
    """Resumed where the text ended, it goes on as the run that never stopped: the same ids and
    logits, bit for bit."""
    from larqlpy.api.model import Model
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.sequence import Sequence
    from larqlpy.decode.stream import generate_step
    from larqlpy.state.saved import FileSource

    toks, stop, want, kept = across
    cli("run", smol_dir, PROMPT, "-n", 24, "--weights", "int8", "--stop", stop, "--save-state", tmp_path / "s.lqkv")
    source = FileSource(smol8, tmp_path / "s.lqkv")
    seq = Sequence(smol8.model, source.tokens, source.spec(None), GenerationConfig(max_tokens=6, stop_at_eos=False),
                   source=source)
    resumed = list(generate_step(smol8.model, seq))
    assert seq.info["reused_tokens"] == len(source.tokens) - 1
    straight = list(Model(smol8).generate(PROMPT, max_tokens=kept + 6, stop_at_eos=False))[kept:]
    assert [t.id for t in resumed] == [t.id for t in straight]
    assert all(torch.equal(a.logits, b.logits) for a, b in zip(resumed, straight))
    again = json.loads(cli("run", smol_dir, "", "--resume", tmp_path / "s.lqkv", "-n", 6, "--weights", "int8",
                           "--json"))
    assert again["tokens"] and again["tokens"] == [t.id for t in straight][:len(again["tokens"])]
