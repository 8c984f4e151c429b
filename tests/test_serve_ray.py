"""`larqlpy serve --ray`: routing keys and the affinity map, replicas sharing a state directory (a
turn resumed from another replica's file), and on a local Ray cluster: conversations landing on
the replica that holds their state with the answers of one server, and (heavy) a replica killed
mid-run losing nothing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conftest import SMOL_DIR
from conversations import Launched, Turn, converse
from larqlpy.budget import KVBudget
from larqlpy.config import GenerationConfig
from larqlpy.decode.scheduler import Scheduler
from larqlpy.pipeline.prepare import prepare
from larqlpy.pipeline.request import Request
from larqlpy.server.affinity import Affinity, Keys, keys_of
from larqlpy.server.balance import Load
from larqlpy.state.prefix_cache import REPLICAS, PrefixCache
from larqlpy.weights.loader import load
from tiny import make_tiny

MODEL = SMOL_DIR.name
ARGS = ("--weights", "int8", "--parallel", "4")


def body(**kw) -> bytes:
    return json.dumps({"model": "m", **kw}).encode()


def test_a_conversations_next_turn_carries_the_key_its_last_turn_left():
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    second = first + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    a, b = keys_of(body(messages=first)), keys_of(body(messages=second))
    assert len(a.prefixes) == 2 and b.prefixes[:2] == a.prefixes and len(b.prefixes) == 4
    assert keys_of(body(messages=first, tools=[{"type": "function"}])).prefixes[-1] != a.prefixes[-1]
    assert keys_of(body(input="Hi", previous_response_id="resp_1")).previous == "resp_1"
    prompt = "x" * 600
    assert keys_of(body(prompt=prompt + "y" * 300)).prefixes[:2] == keys_of(body(prompt=prompt)).prefixes
    assert keys_of(b"{not json") == Keys() and keys_of(b"[1]") == Keys()


def test_the_map_finds_the_longest_known_prefix_on_a_live_replica_and_counts_where_turns_land():
    m = Affinity(most=3)
    m.record(Keys(("a",)), "r1")
    m.record(Keys(("a", "b")), "r2", response="resp_x")
    assert m.lookup(Keys(("a", "b", "c")), {"r1", "r2"}) == "r2"
    assert m.lookup(Keys(("a", "b", "c")), {"r1"}) is None  # its replica is gone: the least loaded takes it
    assert m.lookup(Keys(previous="resp_x"), {"r2"}) == "r2"
    assert [m.count(Keys(("a", "b")), r) for r in ("r2", "r1")] + [m.count(Keys(("z",)), "r1")] == \
        ["hit", "moved", "new"]
    assert m.count(Keys(), "r1") is None  # /health: no conversation
    m.record(Keys(("d",)), "r1")  # past `most`: the least recently recorded key goes
    assert m.known(Keys(("a",))) is None and m.stats()["hit_rate"] == 0.5


def test_a_burst_of_new_conversations_spreads_before_any_lands_and_a_held_state_comes_first():
    load = Load()
    picks = [load.ranked(["b", "a"], request=f"r{i}")[0] for i in range(6)]
    assert sorted(picks) == ["a"] * 3 + ["b"] * 3  # ranked before any was accepted: the plans count
    for i, r in enumerate(picks):
        load.placed(f"r{i}", r)
    for r in ["a"] * 3 + ["b"] * 3:
        load.done(r)
    assert load.ranked(["a", "b"], request="x", first="a")[0] == "a"  # the replica holding its state
    assert load.ranked(["a", "b"], request="y")[0] == "b"  # a has x planned (ties go to a)
    load.placed("x", "a")
    load.placed("y", "b")
    load.done("a")
    assert load.ranked(["b", "a"]) == ["a", "b"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=64)
    return load(d, device="cpu")


def turn(loaded, cache: PrefixCache, ids: list[int]):
    seq = prepare(loaded, Request(ids=tuple(ids), gen=GenerationConfig(max_tokens=6, stop_at_eos=False)),
                  source=cache)
    list(Scheduler(loaded.model, parallel=1).run([seq]))
    cache.put(seq.held())
    return seq


def test_a_turn_on_another_replica_resumes_from_the_file_its_replica_wrote(tiny, tmp_path):
    a = PrefixCache(tiny, KVBudget(), state_dir=tmp_path, replica="a")
    b = PrefixCache(tiny, KVBudget(), state_dir=tmp_path, replica="b")
    alone = PrefixCache(tiny, KVBudget())  # one server: the follow-up continues the state in memory
    prompt = [2] + [7 + i % 90 for i in range(40)]
    first, _ = turn(tiny, a, prompt), turn(tiny, alone, prompt)
    files = list((tmp_path / REPLICAS / "a").glob("*.lqkv"))
    assert len(files) == 1  # written as it was kept, not at shutdown
    follow = first.held().tokens + [11, 12, 13]
    moved = turn(tiny, b, follow)  # b never saw it: it lists a's directory, reads the file
    stayed = turn(tiny, alone, follow)
    assert moved.held_from == stayed.held_from == len(first.held().tokens) - 1
    assert moved.output == stayed.output
    assert files[0].is_file()  # b never removes a file of a's
    turn(tiny, a, first.held().tokens + [21, 22])  # a's newer state supersedes its first file
    assert [p.name for p in (tmp_path / REPLICAS / "a").glob("*.lqkv")] not in ([], [files[0].name])
    assert b.disk_bytes() == sum(p.stat().st_size for p in (tmp_path / REPLICAS / "b").glob("*.lqkv")) > 0
    for cache in (a, b, alone):
        cache.close()


def test_ray_flags_are_refused_without_ray_and_out_of_order(cli):
    code, _, err = cli("serve", str(SMOL_DIR), "--replicas", "2")
    assert code == 2 and "--replicas, --replica-cpus, --min-replicas" in err and err.count("\n") == 1
    code, _, err = cli("serve", str(SMOL_DIR), "--ray", "local", "--min-replicas", "3", "--max-replicas", "2")
    assert code == 2 and "--min-replicas 3 is more than --max-replicas 2" in err


@pytest.fixture(scope="module")
def single():
    pytest.importorskip("openai")
    # the replicas' one thread each: some kernels' numbers follow the thread count (greedy answers
    # of one server at 1 and at 2 threads can part), so the reference runs at 1 too
    server = Launched(str(SMOL_DIR), *ARGS, env={"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(single):
    pytest.importorskip("ray.serve")
    server = Launched(str(SMOL_DIR), *ARGS, "--ray", "local", "--replicas", "2")
    yield server
    server.stop()


def texts(convs) -> list[list[str]]:
    return [[t.text if isinstance(t, Turn) else t for t in c] for c in convs]


def test_turns_land_on_the_replica_holding_their_state_with_one_servers_answers(single, replicas):
    ids = range(4)
    ref, _ = asyncio.run(converse(single, MODEL, ids, 3, 10, stream=False))
    got, _ = asyncio.run(converse(replicas, MODEL, ids, 3, 10, stream=True))
    assert texts(got) == texts(ref)
    for conv in got:
        for before, after in zip(conv, conv[1:]):
            assert after.cached == before.prompt + before.completion - 1  # all earlier tokens, kept

    router = httpx.get(replicas.url + "/router", timeout=10).json()
    assert (router["hit"], router["moved"], router["new"]) == (8, 0, 4)  # /health and the like: no turns


@pytest.mark.heavy
def test_a_replica_killed_mid_run_loses_no_conversation_and_no_answer_changes(single, replicas):
    ids = range(10, 16)
    ref, _ = asyncio.run(converse(single, MODEL, ids, 3, 16, stream=False))
    before = httpx.get(replicas.url + "/router", timeout=10).json()
    got, killed = asyncio.run(converse(replicas, MODEL, ids, 3, 16, stream=False, kill_after=len(ids) + 1))
    assert killed is not None
    assert texts(got) == texts(ref)  # no failed request, every answer as one server gives it
    assert httpx.get(replicas.url + "/router", timeout=10).json()["moved"] > before["moved"]  # its turns moved
