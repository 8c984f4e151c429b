"""The state file: one session's attention state, saved atomically and loaded with every check.

Layout (little-endian):

    0   8  magic  b"LARQLKV\\0"
    8   4  format version (1)
    12  4  reserved (0)
    16  8  header length H
    24  4  CRC32 of the header
    28  4  reserved (0)
    32  H  header: UTF-8 JSON -- model and tokenizer fingerprints, engine identity and options,
           token ids, the processed count, the layers, and the cell table (layer, set, positions,
           state, precision, and per field: dtype, shape, offset, length, CRC32)
    ... zero padding to a 4096-byte boundary: the data area, read through mmap
    data   each field's bytes at its offset (64-byte aligned); the last position's logits too

Saving (store.py) goes through larqlpy.files.atomic_write: a crash at any moment leaves the previous
complete state in place, and the next save removes what a killed writer left.

This module reads and checks files without torch (`state inspect` needs nothing else); store.py
writes them and restores them into an engine state.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from larqlpy.engines.stores.mapped import MappedFile, open_mapped
from larqlpy.errors import LarqlError

MAGIC = b"LARQLKV\0"
VERSION = 1
PREFIX = struct.Struct("<8sIIQII")  # magic, version, reserved, header length, header crc, reserved
PAGE = 4096
ALIGN = 64


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class SavedState:
    """A loaded, verified state file: what `restore_state` needs."""

    path: Path
    header: dict
    records: dict[int, list[tuple[dict, dict]]]  # layer -> (cell meta, field -> array view)
    logits: np.ndarray | None  # float32 (V,): the last processed position's
    backing: MappedFile  # keeps the mmap open for PERSISTED cells

    @property
    def tokens(self) -> list[int]:
        return self.header["tokens"]

    @property
    def processed(self) -> int:
        return self.header["processed"]


def jsonable(options: dict) -> dict:
    return json.loads(json.dumps(options, default=str))


def load_state(path: str | Path) -> SavedState:
    """Read and verify a state file. Every problem is a one-line LarqlError naming what is wrong."""
    path = Path(path)
    if path.is_dir():
        raise LarqlError(f"{path}: is a directory, not a state file")
    if not path.is_file():
        raise LarqlError(f"{path}: no such state file")
    size = path.stat().st_size
    header, data_offset = _read_header(path, size)
    entries, need = _entries(path, header)
    if data_offset + need > size:
        raise LarqlError(f"{path}: truncated: data needs {data_offset + need} bytes, file has {size}")
    backing = open_mapped(path, data_offset)
    logits = None
    for cell, name, e in entries:
        arr = backing.read((e["offset"], e["length"], e["dtype"], tuple(e["shape"])))
        if zlib.crc32(arr) != e["crc32"]:
            what = "logits" if cell is None else \
                f"cell layer {cell['layer']} positions {cell['start']}-{cell['start'] + cell['n']} ({name})"
            raise LarqlError(f"{path}: checksum mismatch in {what}")
        if cell is None:
            logits = arr.copy()
    records: dict[int, list[tuple[dict, dict]]] = {}
    for cell in header["cells"]:
        meta = {k: cell[k] for k in ("set", "start", "n", "state", "precision")}
        locs = {name: (e["offset"], e["length"], e["dtype"], tuple(e["shape"])) for name, e in cell["fields"].items()}
        meta["_where"] = (backing, locs)
        records.setdefault(cell["layer"], []).append((meta, {name: backing.read(loc) for name, loc in locs.items()}))
    return SavedState(path, header, records, logits, backing)


def read_tokens(path: str | Path) -> tuple[list[int], int]:
    """A state file's token ids and processed count, from its checked header alone (no data read):
    what a server needs to list a file another server wrote."""
    path = Path(path)
    header, _ = _read_header(path, path.stat().st_size)
    tokens, processed = header.get("tokens"), header.get("processed")
    if not (isinstance(tokens, list) and isinstance(processed, int) and 0 <= processed <= len(tokens)):
        raise LarqlError(f"{path}: malformed header (tokens)")
    return tokens, processed


def _read_header(path: Path, size: int) -> tuple[dict, int]:
    """The checked header bytes as JSON, and where the data area starts."""
    with open(path, "rb") as f:
        prefix = f.read(PREFIX.size)
        if len(prefix) < PREFIX.size:
            raise LarqlError(f"{path}: not a larqlpy state file (too short: {size} bytes)")
        magic, version, _, header_len, header_crc, _ = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise LarqlError(f"{path}: not a larqlpy state file (bad magic)")
        if version != VERSION:
            raise LarqlError(f"{path}: state format version {version} is not supported (this larqlpy reads {VERSION})")
        if PREFIX.size + header_len > size:
            raise LarqlError(f"{path}: truncated: header of {header_len} bytes, file has {size}")
        raw = f.read(header_len)
    if zlib.crc32(raw) != header_crc:
        raise LarqlError(f"{path}: header checksum mismatch (the file is corrupted)")
    try:
        return json.loads(raw), align(PREFIX.size + header_len, PAGE)
    except ValueError as e:
        raise LarqlError(f"{path}: malformed header ({e})") from None


def _entries(path: Path, header: dict) -> tuple[list, int]:
    """Every field the header places in the data area, as (cell or None for the logits, name, entry),
    each checked, and the data bytes they need."""
    try:
        entries = [(c, name, e) for c in header["cells"] for name, e in c["fields"].items()]
        if header["logits"] is not None:
            entries.append((None, "logits", header["logits"]))
        need = max((e["offset"] + e["length"] for _, _, e in entries), default=0)
        tokens, processed = header["tokens"], header["processed"]
        if not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
                and isinstance(processed, int) and 0 <= processed <= len(tokens)):
            raise ValueError("bad token list")
        for c in header["cells"]:
            for key in ("layer", "start", "n"):
                if not isinstance(c[key], int) or c[key] < 0:
                    raise ValueError(f"bad cell {key}")
        for _, _, e in entries:
            if e["offset"] < 0 or e["length"] < 0 or np.prod(e["shape"]) * np.dtype(e["dtype"]).itemsize != e["length"]:
                raise ValueError("bad field extent")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LarqlError(f"{path}: malformed header ({e})") from None
    return entries, need


# What the numbers in a state depend on beyond model, tokenizer and engine: the header's field, its
# value in files that predate it, and the parameter that sets it.
NUMERICS = (("weights", "f32"), ("dtype", "float32"), ("device", "cpu"), ("kv_dtype", "f32"))


def check_compatible(saved: SavedState, *, model_fingerprint: str, tokenizer_fingerprint: str,
                     identity: str, options: dict, numerics: dict[str, str], made_options: dict | None = None) -> None:
    """Refuse a state whose rows another model, tokenizer, engine, weight format, dtype or device made:
    continuing from it would not give the numbers an uninterrupted run gives. `made_options`: the
    saved engine's options as they read now (an option it predates at what it meant then)."""
    h, p = saved.header, saved.path
    if h["model_fingerprint"] != model_fingerprint:
        raise LarqlError(f"{p}: made with a different model (fingerprint {h['model_fingerprint']}, "
                         f"this model {model_fingerprint})")
    for name, default in NUMERICS:  # the K/V rows depend on the arithmetic that made them
        made, now = h.get(name, default), numerics[name]
        if made != now:
            raise LarqlError(f"{p}: made with `{name}` {made}, this run loads the model with `{name}` {now}; "
                             f"resume with the same `{name}`")
    made = h.get("weights_digest")  # a state that predates it: the fingerprint's sample of the bytes alone
    if made is not None and numerics.get("weights_digest", made) != made:
        raise LarqlError(f"{p}: made with other weights (the model's weight files have changed since it was "
                         "saved); drop `resume` to prefill afresh")
    if h["tokenizer_fingerprint"] != tokenizer_fingerprint:
        raise LarqlError(f"{p}: made with a different tokenizer (fingerprint {h['tokenizer_fingerprint']}, "
                         f"this one {tokenizer_fingerprint})")
    want = {"identity": identity, "options": jsonable(options)}
    made = h["engine"] if made_options is None else {"identity": h["engine"]["identity"],
                                                     "options": jsonable(made_options)}
    if made != want:
        raise LarqlError(f"{p}: made with engine {_engine_str(made)}, this run asks for {_engine_str(want)}; "
                         "refusing (resume with the same engine, or drop `resume` to prefill afresh)")


def _engine_str(e: dict) -> str:
    opts = ",".join(f"{k}={v}" for k, v in sorted(e.get("options", {}).items()))
    return e.get("identity", "?") + (f" [{opts}]" if opts else "")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(saved: SavedState) -> dict:
    """What `state inspect` shows: the header's identity fields, and per layer its retained range and
    cells grouped by state and precision (count, positions, bytes)."""
    h = saved.header
    by_layer: dict[int, dict[str, list[int]]] = {}
    for c in h["cells"]:
        slot = by_layer.setdefault(c["layer"], {}).setdefault(f"{c['state']} {c['precision']}", [0, 0, 0])
        slot[0] += 1
        slot[1] += c["n"]
        slot[2] += sum(f["length"] for f in c["fields"].values())
    return {"path": str(saved.path), "bytes": saved.path.stat().st_size, "format": h["format"],
            "larqlpy": h.get("larqlpy"), "model_fingerprint": h["model_fingerprint"],
            "tokenizer_fingerprint": h["tokenizer_fingerprint"], "weights": h.get("weights", "f32"),
            "kv_dtype": h.get("kv_dtype", "f32"),
            "engine": h["engine"], "tokens": len(h["tokens"]), "processed": h["processed"],
            "layers": [{"index": layer["index"], "kind": layer["kind"], "retained": layer["retained"],
                        "cells": {k: {"cells": v[0], "positions": v[1], "bytes": v[2]}
                                  for k, v in sorted(by_layer.get(layer["index"], {}).items())}}
                       for layer in h["layers"]]}
