"""codec/v1's safe defaults (issue 30): calib=auto, sink=1, recent=16 unless given; the calibration
measured once by the request pipeline and cached (beside the weights, or under ~/.cache/larqlpy),
refused when the weights change; states record what was used, and a state saved before the
defaults resumes as it was saved."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute
from larqlpy.cli.common import error_line
from larqlpy.engines import parse_engine_spec
from larqlpy.engines.presets import CODEC_DEFAULTS, CODEC_PLAIN
from larqlpy.errors import LarqlError
from larqlpy.state.format import load_state
from larqlpy.state.saved import save
from larqlpy.weights import calibration_file, checkpoint
from larqlpy.weights.loader import load
from test_state import PROMPT, resume, resume_elsewhere, run
from tiny import make_tiny, write_in_place


def codec(*options: str):
    return parse_engine_spec(continuation="codec/v1", options=list(options))


def generate(model_dir, *options: str) -> dict:
    """One request through the pipeline every entry point shares, on a model loaded afresh."""
    req = Request.from_api("a b c", continuation="codec/v1", options=dict(o.split("=") for o in options),
                           max_tokens=3)
    return execute(load(model_dir), req)


def test_defaults_fill_what_is_not_given_and_explicit_options_override():
    assert codec("bits=4").options_dict == {"bits": 4, **dict(CODEC_DEFAULTS)}
    plain = codec("bits=4", "calib=off", "sink=0", "recent=0").options_dict
    assert plain == {"bits": 4, **dict(CODEC_PLAIN)}
    assert codec("bits=3", "recent=64").options_dict["recent"] == 64
    with pytest.raises(LarqlError, match="recent_bits needs recent=N"):
        codec("bits=4", "recent=0", "recent_bits=4")
    with pytest.raises(LarqlError, match="expected auto or on or off"):
        codec("bits=4", "calib=yes")


@pytest.fixture
def tiny_dir(tmp_path):
    d = tmp_path / "tiny"
    make_tiny(d, sliding_window=16)
    return d


def test_the_calibration_is_measured_once_cached_and_refused_when_the_weights_change(tiny_dir, monkeypatch):
    monkeypatch.setattr(checkpoint, "SAMPLE", 64)  # the tiny file's ends: like 1 MB of a 1 GB file's
    first = generate(tiny_dir, "bits=4")
    assert any("measured the key calibration" in n for n in first["notes"])
    assert (tiny_dir / calibration_file.FILE).exists()
    loaded = load(tiny_dir)
    assert loaded.model.key_calibration is not None  # read at load from now on
    again = generate(tiny_dir, "bits=4")
    assert not any("measured" in n for n in again.get("notes", []))
    assert again["tokens"] == first["tokens"]
    # other weights (an edit the fingerprint's sample of the file misses): the cached calibration is
    # refused, never used, and measured afresh for them
    write_in_place(tiny_dir / "model.safetensors", "model.layers.1.mlp.up_proj.weight", np.full(8, 0.75))
    edited = load(tiny_dir)
    assert edited.fingerprint == loaded.fingerprint
    assert edited.model.key_calibration is None and "measured on other weights" in edited.model.calibration_problem
    third = generate(tiny_dir, "bits=4")
    assert any("measured on other weights" in n for n in third["notes"])  # said why it measured again
    assert load(tiny_dir).model.key_calibration is not None


def test_a_read_only_model_caches_its_calibration_under_the_user_cache(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real = os.access  # root writes a 0555 folder all the same: refuse the model folder as a user's would
    monkeypatch.setattr(calibration_file.os, "access", lambda p, mode: False if Path(p) == tiny_dir else real(p, mode))
    os.chmod(tiny_dir, 0o555)
    try:
        generate(tiny_dir, "bits=4")
    finally:
        os.chmod(tiny_dir, 0o755)
    loaded = load(tiny_dir)
    cached = calibration_file.fallback_dir(loaded.fingerprint) / calibration_file.FILE
    assert cached.exists() and not (tiny_dir / calibration_file.FILE).exists()
    assert loaded.model.key_calibration is not None


def test_a_state_records_the_options_used(tiny_dir, tmp_path):
    generate(tiny_dir, "bits=4")  # calibrates
    loaded = load(tiny_dir)
    _, held = run(loaded, codec("bits=4"), PROMPT, 4)
    save(loaded, tmp_path / "s.kv", held)
    assert load_state(tmp_path / "s.kv").header["engine"]["options"] == {"bits": 4, "calib": "on", "recent": 16,
                                                                       "sink": 1}
    got, _, _ = resume(loaded, tmp_path / "s.kv", None, codec("bits=4"))  # auto resolves to on here too
    assert got.held.state.position == len(PROMPT) + 3


def test_a_state_saved_before_the_defaults_resumes_as_it_was_saved(tiny_dir, tmp_path):
    generate(tiny_dir, "bits=4")  # the model now has a calibration: the old state must still not use it
    loaded = load(tiny_dir)
    plain = codec("bits=4", "calib=off", "sink=0", "recent=0")
    whole, _ = run(loaded, plain, PROMPT, 20)
    _, held = run(loaded, plain, PROMPT, 8)
    held.state.options = {"bits": 4}  # what a state saved before the defaults recorded
    save(loaded, tmp_path / "old.kv", held)
    _, spec, _ = resume(loaded, tmp_path / "old.kv", None, None)
    assert spec.options_dict == plain.options_dict
    got = resume_elsewhere(tiny_dir, tmp_path / "old.kv", 12, tmp_path)
    assert [t.id for t in whole[8:]] == got["ids"]
    assert torch.equal(torch.stack([t.logits for t in whole[8:]]), got["logits"])
    with pytest.raises(LarqlError) as e:  # asked for today's defaults: another engine, refused in one line
        resume(loaded, tmp_path / "old.kv", None, codec("bits=4"))
    line = error_line(e.value)
    assert "calib=off,recent=0,sink=0" in line and "calib=on,recent=16,sink=1" in line


def cells(*options: str):
    return parse_engine_spec(continuation="cells/v1", options=list(options))


def test_cells_quantize_keys_under_the_calibration_by_default_and_old_states_resume_as_saved(tiny_dir, tmp_path):
    assert cells().options_dict == {"calib": "auto"}
    generate(tiny_dir, "bits=4")  # calibrates
    loaded = load(tiny_dir)
    _, held = run(loaded, cells(), PROMPT, 4)
    assert held.state.options["calib"] == "on"  # what applied, recorded
    assert all(s.calibration is not None for s in held.state.layers)
    save(loaded, tmp_path / "c.kv", held)
    assert load_state(tmp_path / "c.kv").header["engine"]["options"]["calib"] == "on"
    _, off = run(loaded, cells("calib=off"), PROMPT, 4)
    assert off.state.options["calib"] == "off" and all(s.calibration is None for s in off.state.layers)
    off.state.options = {}  # a state saved before cells had the option
    save(loaded, tmp_path / "old.kv", off)
    _, spec, _ = resume(loaded, tmp_path / "old.kv", None, None)
    assert spec.options_dict["calib"] == "off"


def test_a_format_1_calibration_still_loads_and_calibrate_if_needed_measures_it_again(tiny_dir, capsys, monkeypatch):
    import sys

    from larqlpy.cli.main import main

    generate(tiny_dir, "bits=4")
    c = load(tiny_dir).config
    layers, _ = calibration_file.read(tiny_dir, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    meta = {"format": "larqlpy-kv-calibration/1"}
    calibration_file.save(tiny_dir, [(m + 0.5, s) for m, s, _ in layers], meta)  # every mean fixed
    old = load(tiny_dir).model.key_calibration
    assert old is not None and all(c.turning is None for c in old)
    assert torch.equal(old[0].mean, torch.from_numpy(layers[0][0] + 0.5))
    monkeypatch.setattr(sys, "argv", ["larqlpy", "calibrate", str(tiny_dir), "--if-needed"])
    with pytest.raises(SystemExit):
        main()
    assert "calibrating again" in " ".join(capsys.readouterr().err.split())
    assert calibration_file.format_of(tiny_dir) == calibration_file.FORMAT
