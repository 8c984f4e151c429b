"""The record of what is known about weight files (the tensors checked finite, the file's digest): an
unchanged file is not read again, a changed one is, and a file changed just before it was read is not
recorded at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from larqlpy.errors import LarqlError
from larqlpy.weights import known_files, packed_cache
from larqlpy.weights.loader import load
from tiny import make_tiny


@pytest.fixture
def tiny_dir(tmp_path):
    make_tiny(tmp_path / "m")
    return tmp_path / "m"


@pytest.fixture
def checked(monkeypatch):
    """The names of the tensors `check_finite` reads, per load."""
    seen: list[str] = []
    real = known_files.check_finite

    def counting(file, name, a):
        seen.append(name)
        real(file, name, a)

    monkeypatch.setattr(known_files, "check_finite", counting)
    return seen


def test_an_unchanged_file_is_not_checked_again(tiny_dir, checked, monkeypatch):
    monkeypatch.setattr(known_files, "RACY_NS", 0)  # the file was written a moment ago
    first = load(tiny_dir, device="cpu")
    assert len(checked) == len(first.held_weights())
    record = packed_cache.cache_dir(tiny_dir) / known_files.NAME
    assert record.is_file()
    checked.clear()
    again = load(tiny_dir, device="cpu")
    assert checked == []
    assert all(torch.equal(a, b) for a, b in zip(first.held_weights(), again.held_weights()))


def test_a_changed_file_is_checked_again_and_refused(tiny_dir, checked, monkeypatch):
    monkeypatch.setattr(known_files, "RACY_NS", 0)
    load(tiny_dir, device="cpu")
    w = load_file(str(tiny_dir / "model.safetensors"))
    w["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan  # same size, same name, other bytes
    save_file(w, str(tiny_dir / "model.safetensors"))
    checked.clear()
    with pytest.raises(LarqlError, match="model.layers.1.mlp.up_proj.weight holds 1 non-finite"):
        load(tiny_dir, device="cpu")
    assert checked  # read again, not trusted from the record


def test_a_file_changed_just_before_its_check_is_not_recorded(tiny_dir, checked):
    load(tiny_dir, device="cpu")  # make_tiny wrote it well inside RACY_NS
    assert not (packed_cache.cache_dir(tiny_dir) / known_files.NAME).exists()
    checked.clear()
    load(tiny_dir, device="cpu")
    assert checked


def test_a_damaged_record_means_every_file_is_checked(tiny_dir, checked, monkeypatch):
    monkeypatch.setattr(known_files, "RACY_NS", 0)
    load(tiny_dir, device="cpu")
    (packed_cache.cache_dir(tiny_dir) / known_files.NAME).write_text("[not json")
    checked.clear()
    load(tiny_dir, device="cpu")
    assert checked


def test_a_load_vouches_only_for_the_tensors_it_checked(tiny_dir, checked, monkeypatch):
    """A low-bit load takes its matrices from the packed cache and checks only the rest of the file
    (the norms): a later f32 load still checks the matrices."""
    monkeypatch.setattr(known_files, "RACY_NS", 0)
    load(tiny_dir, device="cpu", weights="int8")  # builds the packed cache: every tensor checked
    (packed_cache.cache_dir(tiny_dir) / known_files.NAME).unlink()
    checked.clear()
    load(tiny_dir, device="cpu", weights="int8")  # from the cache: the norms alone
    assert checked and not any(n.endswith("proj.weight") or "embed" in n for n in checked)
    checked.clear()
    f32 = load(tiny_dir, device="cpu")
    assert any(n.endswith("q_proj.weight") for n in checked) and "model.embed_tokens.weight" in checked
    assert not any(n.endswith("norm.weight") for n in checked)  # those passed in the int8 load
    checked.clear()
    load(tiny_dir, device="cpu")
    assert checked == [] and len(f32.held_weights()) > 0


def test_a_digest_is_kept_while_the_file_is_unchanged(tiny_dir, monkeypatch):
    """The packed-weight cache is checked against each source file's digest: taken from the record
    while the file keeps its identity, hashed again once it has a new one (a touch: same bytes, the
    cache still serves)."""
    import os

    monkeypatch.setattr(known_files, "RACY_NS", 0)
    hashed: list[str] = []
    real = known_files.file_digest
    monkeypatch.setattr(known_files, "file_digest", lambda f: hashed.append(f.name) or real(f))
    load(tiny_dir, device="cpu", weights="int8")
    assert hashed == ["model.safetensors"]
    hashed.clear()
    assert load(tiny_dir, device="cpu", weights="int8").packed_from == "cache" and hashed == []
    os.utime(tiny_dir / "model.safetensors")
    assert load(tiny_dir, device="cpu", weights="int8").packed_from == "cache" and hashed == ["model.safetensors"]
