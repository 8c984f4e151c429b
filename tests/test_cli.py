"""The command line: output channels, JSON, and one-line refusals with exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d)
    return d


def assert_refused(result, *needles):
    rc, out, err = result
    assert rc == 2, (rc, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("larqlpy: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_run_streams_text_and_stats_go_to_stderr(cli, real_dir):
    rc, out, err = cli("run", real_dir, "Question: What is the capital of France? Answer:", "-n", "4", "--stats")
    assert rc == 0
    assert out.strip().startswith("Paris")
    assert "canonical/v1" in err and "decode" in err and "resident KV" in err
    assert "canonical/v1" not in out


def test_run_json_is_one_object(cli, real_dir):
    rc, out, err = cli("run", real_dir, "-", "-n", "5", "--json", stdin="The capital of France is")
    assert rc == 0 and err == ""
    obj = json.loads(out)
    assert len(obj["tokens"]) == 5 and obj["engine"] == "canonical/v1" and obj["finish_reason"] == "length"
    assert obj["stats"]["resident_kv_bytes"] > 0 and obj["stats"]["prompt_tokens"] == 6


def test_sampling_flags_are_reproducible(cli, tiny_dir):
    args = ("run", tiny_dir, "the", "-n", "12", "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9",
            "--seed", "7", "--json")
    a, b = cli(*args), cli(*args)
    assert a[0] == 0 and json.loads(a[1])["tokens"] == json.loads(b[1])["tokens"]


def test_info(cli, real_dir):
    rc, out, _ = cli("info", real_dir, "--json")
    d = json.loads(out)
    assert rc == 0 and d["layers"] == 18 and d["parameters"] == 268_098_176
    assert [i for i, k in enumerate(d["layer_kinds"]) if k == "global"] == [5, 11, 17]
    assert d["key_calibration"].startswith("kv_calibration.safetensors (")  # make model measures one


def test_missing_and_incomplete_model_dirs(cli, tmp_path, tiny_dir):
    assert_refused(cli("run", tmp_path / "nope", "hi"), "no such model directory")
    assert_refused(cli("run", tmp_path, "hi"), "no config.json")
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    shutil.copy(tiny_dir / "config.json", incomplete)
    shutil.copy(tiny_dir / "tokenizer.json", incomplete)
    assert_refused(cli("run", incomplete, "hi"), "no model.safetensors")
    (incomplete / "config.json").write_text("{ not json")
    assert_refused(cli("run", incomplete, "hi"), "not valid JSON")


def test_unsupported_model_type(cli, tmp_path, tiny_dir):
    d = tmp_path / "falcon"  # llama, qwen2, ... are families now (tests/test_families.py); falcon is not
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (d / "config.json").write_text(json.dumps(cfg))
    assert_refused(cli("run", d, "hi"), "unsupported model_type 'falcon'")


def test_shape_mismatch(cli, tmp_path, tiny_dir):
    d = tmp_path / "shape"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))
    assert_refused(cli("run", d, "hi"), "has shape", "expected")


def test_truncated_safetensors(cli, tmp_path, tiny_dir):
    d = tmp_path / "trunc"
    shutil.copytree(tiny_dir, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert_refused(cli("run", d, "hi"), "model.safetensors")
    f.write_bytes(b"\x01")
    assert_refused(cli("run", d, "hi"), "not a readable safetensors file")


def test_missing_tensor(cli, tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "missing"
    shutil.copytree(tiny_dir, d)
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.2.mlp.up_proj.weight"]
    save_file(w, str(d / "model.safetensors"))
    assert_refused(cli("run", d, "hi"), "missing tensor model.layers.2.mlp.up_proj.weight")


@pytest.mark.parametrize("args, needle", [
    (("--continuation", "nope/v1"), "unknown continuation identity 'nope/v1'"),
    (("--continuation", "canonical"), "malformed identity"),
    (("--engine", "warp-drive"), "unknown engine 'warp-drive'"),
    (("--engine", "standard:x=1"), "unknown parameter 'x'"),
    (("--engine", "standard:"), "malformed engine spec"),
    (("--continuation", "canonical/v1", "--continuation-option", "bits"), "malformed option"),
    (("--continuation", "canonical/v1", "--continuation-option", "bits=4"), "has no option 'bits'"),
    (("--continuation-option", "bits=4"), "--continuation-option needs --continuation"),
    (("--engine", "standard", "--continuation", "canonical/v1"), "two spellings"),
    (("--temperature", "-1"), "--temperature must be >= 0"),
    (("--top-p", "0"), "--top-p must be in (0, 1]"),
    (("--device", "tpu"), "--device"),
])
def test_engine_and_flag_refusals(cli, tiny_dir, args, needle):
    assert_refused(cli("run", tiny_dir, "hi", *args), needle)


def test_refusal_before_weights_load(cli, tmp_path):
    # the engine spec is checked first: no model directory needed to be refused
    assert_refused(cli("run", tmp_path / "nope", "hi", "--engine", "warp-drive"), "unknown engine")


def test_console_script_in_a_pipe(tiny_dir):
    """The real entry point, as a shell user runs it: stdin prompt, JSON on stdout, exit codes."""
    exe = [sys.executable, "-m", "larqlpy.cli.main"]
    ok = subprocess.run([*exe, "run", str(tiny_dir), "-", "-n", "3", "--json"], input="the cat",
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and len(json.loads(ok.stdout)["tokens"]) == 3
    bad = subprocess.run([*exe, "run", str(tiny_dir), "hi", "--bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_start_up_ends_with_the_collector_on():
    """entry() turns the garbage collector off for start-up; common.started() freezes what start-up
    made and turns it back on. Every command that loads weights does so through load_model, which
    calls it (a command that forgot would run its whole generation without a collector)."""
    import gc
    from pathlib import Path

    from larqlpy.cli.common import started

    started()  # on already (pytest's process): nothing frozen
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        started()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()
    cli_dir = Path(__file__).resolve().parent.parent / "larqlpy" / "cli"
    direct = [f.name for f in cli_dir.glob("*.py")
              if f.name != "common.py" and "model.loader import" in f.read_text()]
    assert not direct, f"load weights through common.load_model: {direct}"


def test_the_console_script_collects_garbage_after_start_up(tiny_dir):
    """Through the real entry point: the command's generation runs with the collector on."""
    code = ("import gc, sys; from larqlpy.cli import main as m; import larqlpy.pipeline.runner as r; run = r.execute\n"
            "def execute(*a, **k):\n"
            "    sys.stderr.write(f'collector {gc.isenabled()} frozen {gc.get_freeze_count() > 0}\\n')\n"
            "    return run(*a, **k)\n"
            f"r.execute = execute; sys.argv = ['larqlpy', 'run', {str(tiny_dir)!r}, 'hi', '-n', '2']; m.entry()")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert "collector True frozen True" in got.stderr
