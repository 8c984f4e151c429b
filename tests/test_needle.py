"""`larqlpy bench needle` (tools/needle.py): pass-key retrieval on the real 270M at a small size, and
the command's refusals."""

from __future__ import annotations

import json

import pytest

from larqlpy.tools import needle as nd


def test_every_engine_finds_what_canonical_finds_and_cells_hold_their_budget(cli, real_dir, tmp_path):
    plot = tmp_path / "needle.png"
    rc, out, err = cli("bench", "needle", real_dir, "--positions", "1536", "--depths", "0.5", "--json",
                       "--capacity", "64MiB", "--plot", plot)
    assert rc in (0, None), err
    r = json.loads(out)
    rows = {row["engine"]: row for row in r["rows"]}
    assert list(rows) == ["canonical/v1", "codec/v1 bits=4", "codec/v1 bits=3", "cells/v1 budget=1/8 of canonical"]
    key = str(rows["canonical/v1"]["key"])
    assert rows["canonical/v1"]["found"] and key in rows["canonical/v1"]["answer"]
    for name, row in rows.items():
        assert row["found"], (name, row["answer"])
        assert abs(row["prompt_tokens"] - 1536) < 64  # the filler reaches the length asked for
    canonical = rows["canonical/v1"]["resident_kv_bytes"]
    assert rows["codec/v1 bits=3"]["resident_kv_bytes"] < rows["codec/v1 bits=4"]["resident_kv_bytes"] < canonical / 6
    cells = rows["cells/v1 budget=1/8 of canonical"]
    assert cells["budget_bytes"] == int(nd.kv_bytes(_loaded(real_dir), "canonical/v1", (), 1536) / 8)
    assert cells["resident_kv_bytes"] <= cells["budget_bytes"]
    moved = {(t["event"], t["to"]): t["count"] for t in cells["cells"]["transitions"]}
    assert moved[("CACHE_MISS", "RECOVERING")] > 0  # cold cells left memory and came back when read
    cap = {e["engine"]: e["max_positions"] for e in r["capacity"]["engines"]}
    assert cap["codec/v1 bits=3"] >= cap["codec/v1 bits=4"] > 6 * cap["canonical/v1"] > 0
    assert plot.stat().st_size > 0 and r["plot"] == str(plot)
    assert [p.name for p in tmp_path.iterdir()] == ["needle.png"]  # written through its temp file, no litter


def _loaded(path):
    from larqlpy.weights.loader import load

    return load(path, device="cpu", key_calibration=False)


@pytest.mark.parametrize("args, needle", [
    (["--depths", "0.5,1.5"], "--depths"),
    (["--depths", "half"], "--depths"),
    (["--positions", "0"], "--positions"),
    (["--kv-budget", "1/0"], "--kv-budget"),
    (["--kv-budget", "lots"], "--kv-budget"),
    (["--engines", "nope/v1"], "nope/v1"),
    (["--engines", "codec/v1 bits=9"], "bits"),
    (["--capacity", "x"], "--capacity"),
    (["--plot", "out.txt"], "--plot"),
])
def test_bad_input_is_refused_in_one_line_before_the_model_loads(cli, tmp_path, args, needle):
    rc, out, err = cli("bench", "needle", tmp_path / "no-model-here", *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("larqlpy: error:"), err
    assert needle in lines[0] and "Traceback" not in err
