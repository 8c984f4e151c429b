"""cells/v1: the rules file, every rule and illegal transition, the budget, exactness."""

from __future__ import annotations

import itertools

import pytest
import torch

from larqlpy.engines import EngineSpec, build_provider, new_state, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.model.decoder import prefill
from larqlpy.weights.loader import load
from larqlpy.engines.lifecycle import Event, IllegalTransition, State, load_rules, parse_rules
from tiny import make_tiny

F32_ONLY = """version: 1
cell_size: 16
policy: {keep_active_recent: 16, quantize_layers: none, bits: 4}
rules:
  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}
  - {event: READ_REQUEST, from: ACTIVE, to: ACTIVE}
  - {event: MEMORY_PRESSURE, from: ACTIVE, to: PERSISTED}
  - {event: CACHE_MISS, from: PERSISTED, to: RECOVERING}
  - {event: WRITE_BACK, from: RECOVERING, to: PERSISTED}
  - {event: EVICT, from: ACTIVE, to: EVICTED}
  - {event: EVICT, from: PERSISTED, to: EVICTED}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=200)
    return load(d)


def cells_spec(*opts):
    return parse_engine_spec(continuation="cells/v1", options=list(opts))


def test_default_rules_load_and_every_illegal_transition_raises():
    rules = load_rules()
    assert rules.cell_size == 64 and rules.policy.keep_active_recent == 128 and rules.can_reach_disk()
    for ev, src, dst in itertools.product(Event, State, State):
        if rules.allows(ev, src, dst):
            assert rules.apply(ev, src, dst) == dst
        else:
            with pytest.raises(IllegalTransition, match=f"illegal transition {ev.value}: {src.value} -> {dst.value}"):
                rules.apply(ev, src, dst)
    assert sum(rules.counts.values()) == len(rules.allowed)


@pytest.mark.parametrize("text, line, needle", [
    ("version: 1\nrules: [\n", 3, "not valid YAML"),
    ("- a\n- b\n", 1, "expected a mapping"),
    ("version: 2\nrules: []\n", 1, "unsupported rules version"),
    ("version: 1\ncolour: red\nrules: []\n", 2, "unknown key 'colour'"),
    ("version: 1\nrules: []\n", 2, "non-empty list"),
    ("version: 1\ncell_size: 0\nrules: []\n", 2, "cell_size must be an integer >= 1"),
    ("rules:\n  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}\n  - {event: EVICT, from: ACTIVE, to: GONE}\n", 3,
     "unknown state 'GONE'"),
    ("rules:\n  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}\n  - {event: SNEEZE, from: ACTIVE, to: EVICTED}\n", 3,
     "unknown event 'SNEEZE'"),
    ("rules:\n  - {event: TOKEN_APPEND, from: NONE}\n", 2, "needs exactly event, from, to"),
    ("rules:\n  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}\n  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}\n",
     3, "duplicate rule"),
    ("rules:\n  - {event: EVICT, from: NONE, to: ACTIVE}\n", 2, "only TOKEN_APPEND starts from NONE"),
    ("rules:\n  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}\n", 2, "missing transitions the engine needs"),
    ("policy: {bits: 5}\nrules:\n  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}\n", 1, "bits must be 3 or 4"),
    ("policy:\n  quantize_layers: some\nrules:\n  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}\n", 2,
     "quantize_layers must be"),
    ("policy:\n  speed: 3\nrules:\n  - {event: TOKEN_APPEND, from: NONE, to: ACTIVE}\n", 2, "unknown policy key"),
])
def test_rules_errors_name_the_line(text, line, needle):
    with pytest.raises(LarqlError) as exc:
        parse_rules(text, "r.yaml")
    assert str(exc.value).startswith(f"r.yaml:{line}: "), str(exc.value)
    assert needle in str(exc.value)


def test_missing_persist_path_is_refused_up_front_with_a_budget(tmp_path, tiny):
    f = tmp_path / "r.yaml"
    f.write_text(F32_ONLY.replace("  - {event: MEMORY_PRESSURE, from: ACTIVE, to: PERSISTED}\n", ""))
    spec = cells_spec(f"rules={f}", "budget=1MiB")
    with pytest.raises(LarqlError, match="cannot keep resident KV under a budget"):
        new_state(spec, tiny.model.geometries(), tiny.device)
    ok = tmp_path / "ok.yaml"
    ok.write_text(F32_ONLY)
    with pytest.raises(LarqlError, match="is below what the rules keep ACTIVE"):
        new_state(cells_spec(f"rules={ok}", "budget=1KiB"), tiny.model.geometries(), tiny.device)


def test_bad_rules_path_refused_at_parse():
    with pytest.raises(LarqlError, match="rules file /nonexistent.yaml"):
        cells_spec("rules=/nonexistent.yaml")
    with pytest.raises(LarqlError, match="expected a size"):
        cells_spec("budget=lots")


def run_blocks(loaded, spec, ids, block, check=None):
    state = new_state(spec, loaded.model.geometries(), loaded.device)
    outs = []
    for lo in range(0, len(ids), block):
        outs.append(prefill(loaded.model, state, ids[lo:lo + block], block, all_logits=True))
        if check:
            check(state)
    return torch.cat(outs), state


def test_without_budget_and_with_f32_spill_cells_are_exact(tmp_path, tiny):
    ids = [7 + (i * 37) % 280 for i in range(400)]  # past the 200-row window
    ref, _ = run_blocks(tiny, EngineSpec(), ids, 16)
    got, state = run_blocks(tiny, cells_spec(), ids, 16)
    assert torch.equal(ref, got)
    rules = tmp_path / "f32.yaml"
    rules.write_text(F32_ONLY)
    got, unbudgeted = run_blocks(tiny, cells_spec(f"rules={rules}"), ids, 16)
    assert torch.equal(ref, got)
    got, state = run_blocks(tiny, cells_spec(f"rules={rules}", "budget=40KiB"), ids, 16)
    assert torch.equal(ref, got)  # persisted f32 cells read back through mmap are the same rows
    report = state.report()
    moves = {(t["event"], t["from"], t["to"]) for t in report["transitions"] + unbudgeted.report()["transitions"]}
    for rule in F32_ONLY.splitlines():  # every rule of this file fired
        if "event:" in rule:
            ev = rule.split("event: ")[1].split(",")[0]
            src = rule.split("from: ")[1].split(",")[0]
            dst = rule.split("to: ")[1].split("}")[0]
            assert (ev, src, dst) in moves, (ev, src, dst)
    assert report["cells"]["PERSISTED"] > 0 and report["spilled_bytes"] > 0


def test_every_default_rule_fires(tiny):
    ids = [7 + (i * 37) % 280 for i in range(600)]
    _, state = run_blocks(tiny, cells_spec("budget=256KiB"), ids, 64)
    _, unbudgeted = run_blocks(tiny, cells_spec(), ids, 64)  # cells evicted while still ACTIVE
    moves = {(t["event"], t["from"], t["to"])
             for t in state.report()["transitions"] + unbudgeted.report()["transitions"]}
    assert {(e.value, s.value, d.value) for e, s, d in load_rules().allowed} - moves == {
        ("MEMORY_PRESSURE", "ACTIVE", "PERSISTED")}  # only used on layers the policy won't quantize
    rules = load_rules()
    from larqlpy.engines.lifecycle import Policy
    p = build_provider(cells_spec("budget=256KiB"))
    p.rules.policy = Policy(keep_active_recent=128, quantize_layers=(), bits=4)
    state = p.new_state(tiny.model.geometries(), tiny.device)
    prefill(tiny.model, state, ids, 64)
    moves = {(t["event"], t["from"], t["to"]) for t in state.report()["transitions"]}
    assert ("MEMORY_PRESSURE", "ACTIVE", "PERSISTED") in moves and \
        ("MEMORY_PRESSURE", "ACTIVE", "QUANTIZED") not in moves
    assert rules.allowed  # the packaged file is unchanged by any of this


def test_budget_holds_over_1000_positions_of_the_270m(real, long_text):
    budget = 6 * 2**20  # a sixth of what canonical/v1 would hold: past the window, cells are evicted
    ids = real.tokenizer.encode(long_text)[:1000]
    cell = 64 * 2 * 256 * 4
    worst = []

    def check(state):
        cells = sum(s.resident_bytes() for s in state.layers)
        worst.append(cells)
        assert cells <= budget + 18 * cell, cells

    _, state = run_blocks(real, cells_spec("budget=6MiB"), ids, 64, check)
    assert state.position == 1000
    report = state.report()
    assert report["cells"]["PERSISTED"] > 0 and report["cells"]["EVICTED"] > 0
    moves = {(t["event"], t["from"], t["to"]) for t in report["transitions"]}
    assert {("MEMORY_PRESSURE", "ACTIVE", "QUANTIZED"), ("MEMORY_PRESSURE", "QUANTIZED", "PERSISTED")} <= moves
    assert max(worst) > budget * 0.8  # the budget was actually in play


def test_cli_kv_budget(monkeypatch, capsys, real_dir):
    import json
    import sys

    from larqlpy.cli.main import main

    monkeypatch.setattr(sys, "argv", ["larqlpy", "run", str(real_dir), "The history of", "-n", "4", "--kv-budget",
                                      "64MiB", "--json"])
    with pytest.raises(SystemExit) as exc:
        main()
    out = json.loads(capsys.readouterr().out)
    assert exc.value.code == 0 and out["engine"].startswith("cells/v1") and out["budget"] == 64 * 2**20
    assert any(t["event"] == "TOKEN_APPEND" for t in out["transitions"])
    monkeypatch.setattr(sys, "argv", ["larqlpy", "run", str(real_dir), "x", "--kv-budget", "1MiB",
                                      "--continuation", "window/v1"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and "--kv-budget applies to cells/v1" in capsys.readouterr().err
