"""LARQL's two spellings, every refusal, and the accounted residency."""

from __future__ import annotations

import json

import pytest

from larqlpy.cli.common import error_line
from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.tools.residency import residency


def test_v3_and_v2_spellings():
    assert parse_engine_spec() == EngineSpec("canonical/v1")
    assert parse_engine_spec(engine="standard") == EngineSpec("canonical/v1")
    assert parse_engine_spec(continuation="window/v1") == EngineSpec("window/v1")
    assert parse_engine_spec(engine="no-cache") == EngineSpec("canonical/v1", (), replay=True)
    assert parse_engine_spec("no-cache", "window/v1") == EngineSpec("window/v1", (), replay=True)
    assert parse_engine_spec(engine="windowed-checkpoint:window=600") == EngineSpec("window/v1", (("window", 600),))
    assert parse_engine_spec(None, "window/v1", ["window=700"]).options_dict == {"window": 700}
    assert parse_engine_spec("no-cache", "window/v1", ["window=700"]).describe() == "no-cache(window/v1 [window=700])"


@pytest.mark.parametrize("engine, continuation, options, needle", [
    ("warp", None, [], "unknown engine 'warp'"),
    ("Standard", None, [], "malformed engine spec"),
    ("standard:", None, [], "malformed engine spec"),
    ("standard:x=1", None, [], "unknown parameter 'x'"),
    ("no-cache:x=1", None, [], "no-cache takes no parameters"),
    ("windowed-checkpoint:window", None, [], "malformed option"),
    ("windowed-checkpoint:window=", None, [], "malformed option"),
    ("windowed-checkpoint:size=4", None, [], "unknown parameter 'size'"),
    ("windowed-checkpoint:window=abc", None, [], "expected an integer"),
    ("windowed-checkpoint:window=0", None, [], "must be >= 1"),
    ("windowed-checkpoint:window=5,window=6", None, [], "given twice"),
    ("standard", "window/v1", [], "two spellings"),
    (None, None, ["window=4"], "--continuation-option needs --continuation"),
    (None, "nope/v1", [], "unknown continuation identity 'nope/v1'"),
    (None, "window", [], "malformed identity"),
    (None, "Window/v1", [], "malformed identity"),
    (None, "window/v1", ["windw=4"], "has no option 'windw'"),
    (None, "window/v1", ["window=4", "window=5"], "given twice"),
    (None, "window/v1", ["=4"], "malformed option"),
    (None, "canonical/v1", ["window=4"], "has no option 'window'"),
])
def test_refusals(engine, continuation, options, needle):
    with pytest.raises(LarqlError, match=None) as exc:
        parse_engine_spec(engine, continuation, options)
    assert needle in error_line(exc.value)  # as the CLI spells it: flags for parameters
    assert "\n" not in str(exc.value)


def test_turbo_quant_routes_to_codec():
    defaults = (("calib", "auto"), ("recent", 16), ("sink", 1))  # codec/v1's, whatever the spelling
    assert parse_engine_spec(engine="turbo-quant:bits=4") == EngineSpec("codec/v1", (("bits", 4), *defaults))
    assert parse_engine_spec(engine="turbo-quant:bits=3") == EngineSpec("codec/v1", (("bits", 3), *defaults))


@pytest.mark.parametrize("engine, continuation, options, needle", [
    ("turbo-quant", None, [], "codec/v1 requires option bits"),
    ("turbo-quant:bits=5", None, [], "must be one of 3, 4"),
    ("turbo-quant:bits=4,k=1", None, [], "unknown parameter 'k'"),
    (None, "codec/v1", [], "codec/v1 requires option bits"),
    (None, "codec/v1", ["bits=8"], "must be one of 3, 4"),
    (None, "codec/v1", ["bits=4", "exact_recent_k=4"], "has no option 'exact_recent_k'"),
    (None, "codec-recent/v1", ["bits=4"], "requires option exact_recent_k"),
    (None, "codec-recent/v1", ["bits=4", "exact_recent_k=0"], "must be >= 1"),
    (None, "int4-group/v1", ["bits=4"], "has no option 'bits'"),
])
def test_codec_refusals(engine, continuation, options, needle):
    with pytest.raises(LarqlError) as exc:
        parse_engine_spec(engine, continuation, options)
    assert needle in str(exc.value)


def test_gemma3_4b_figures_from_larql():
    r = residency("gemma3-4b", 4096)
    by = {e["engine"]: e for e in r["engines"]}
    assert r["kinds"] == {"sliding": 29, "global": 5}
    assert by["canonical/v1"]["rows"] == 34 * 4096 == 139_264
    assert by["window/v1"]["rows"] == 29 * 1024 + 5 * 4096 == 50_176
    assert by["canonical/v1"]["bytes"] == 139_264 * 8192  # 8 KiB per row per layer: 1.06 GiB
    assert round(by["canonical/v1"]["bytes"] / 2**30, 2) == 1.06
    assert round(by["window/v1"]["bytes"] / 2**30, 2) == 0.38
    assert by["window/v1"]["by_kind"]["sliding"] == {"layers": 29, "rows": 29_696, "bytes": 29_696 * 8192}


def test_residency_of_a_model_directory_matches_live_window_state(real, real_dir):
    import torch

    from larqlpy.engines import new_state

    r = residency(str(real_dir), 700, [parse_engine_spec(continuation="window/v1")])
    state = new_state(parse_engine_spec(continuation="window/v1"), real.model.geometries(), real.device)
    real.model(torch.arange(1000, 1700), state)
    live = state.resident_by_kind()
    assert r["engines"][0]["by_kind"]["sliding"]["bytes"] == live["sliding"]
    assert r["engines"][0]["by_kind"]["global"]["bytes"] <= live["global"]  # canonical rows double in capacity


def test_residency_cli(monkeypatch, capsys):
    import sys

    from larqlpy.cli.main import main

    for named in ("gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"):
        monkeypatch.setattr(sys, "argv", ["larqlpy", "residency", named, "--positions", "4096", "--json"])
        with pytest.raises(SystemExit) as exc:
            main()
        assert exc.value.code == 0
        d = json.loads(capsys.readouterr().out)
        assert {e["engine"] for e in d["engines"]} >= {"canonical/v1", "window/v1"}
    monkeypatch.setattr(sys, "argv", ["larqlpy", "residency", "gemma3-4b", "--positions", "10", "--engine", "no-cache"])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and "no-cache keeps no state" in capsys.readouterr().err


def test_capacity_under_a_budget_is_the_inverse_of_residency(real_dir):
    from larqlpy.tools.residency import capacity

    c = {e["engine"] + str(e["options"].get("bits", "")): e for e in capacity("gemma3-4b", 2 * 2**30)["engines"]
         if e["options"].get("sink") == 0 or e["engine"] != "codec/v1"}  # plain codec/v1, not the recommended ones
    row = 8192  # f32 K+V per position per layer on the 4B geometry
    assert c["canonical/v1"]["max_positions"] == 2 * 2**30 // (34 * row) == 7710
    assert c["window/v1"]["max_positions"] == (2 * 2**30 - 29 * 1024 * row) // (5 * row) == 46489
    per_pos_codec4 = 2 * 4 * (4 + 256 * 4 // 8)  # 2 x KV heads x (norm + codes) per layer
    assert c["codec/v1" + "4"]["max_positions"] == (2 * 2**30 - 29 * 1024 * per_pos_codec4) // (5 * per_pos_codec4)
    for e in c.values():  # one more position would not fit
        assert residency("gemma3-4b", e["max_positions"] + 1, [EngineSpec(e["engine"], tuple(sorted(
            e["options"].items())))], within_context=False)["engines"][0]["bytes"] > 2 * 2**30 >= e["bytes_at_max"]
    d = capacity(str(real_dir), 64 * 2**20, [parse_engine_spec(continuation="window/v1")])
    assert d["engines"][0]["max_positions"] == (64 * 2**20 - 15 * 512 * 2048) // (3 * 2048)


def test_named_geometries_of_every_family():
    from larqlpy.tools.residency import NAMED_GEOMETRIES

    assert {"llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b",
            "mistral-7b-v0.1", "gemma2-2b", "gemma2-9b"} <= set(NAMED_GEOMETRIES)
    by = {e["engine"]: e for e in residency("llama3.1-8b", 4096)["engines"]}
    assert by["canonical/v1"]["bytes"] == 32 * 4096 * 8 * 128 * 2 * 4 == 2**30  # 32 layers, 8 KV heads of 128, f32
    assert by["window/v1"]["rows"] == by["canonical/v1"]["rows"]  # no sliding layers: window keeps every row
    r = residency("llama3.1-8b", 4096)
    assert r["note"] and "no sliding layers" in r["note"]
    mistral = {e["engine"]: e for e in residency("mistral-7b-v0.1", 8192)["engines"]}
    assert mistral["window/v1"]["rows"] == 32 * 4096 and mistral["canonical/v1"]["rows"] == 32 * 8192
    gemma2 = residency("gemma2-9b", 8192)
    assert gemma2["kinds"] == {"sliding": 21, "global": 21} and gemma2["note"] is None
    with pytest.raises(LarqlError, match="past qwen3-0.6b's context of 40,960"):
        residency("qwen3-0.6b", 50000)
