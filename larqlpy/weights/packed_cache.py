"""The packed-weight cache: low-bit matrices (`weights` bf16 / int8 / int4) packed once and kept
beside the model (MODEL/.larqlpy-cache/, or ~/.cache/larqlpy/ when the model directory is not
writable), then memory-mapped at every later load instead of packed again.

One safetensors file per model fingerprint, format, packing version and file layout, written
atomically. A file of another fingerprint, packing version or layout is stale: it is removed and
rebuilt. So is one built from other bytes: its header holds the digest of each file it was packed
from (weights/known_files.py; the fingerprint samples only each end of a file, and an edit of a
middle layer's matrix in place keeps it). A file whose header or checksums do not hold is damaged:
it is refused, naming the file to delete. The checksums are xxh3-64 (xxhash): every load checks
every byte, and xxh3 runs about ten times faster than zlib's CRC32 (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch
import xxhash
from safetensors import safe_open
from safetensors.numpy import save_file

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_path
from larqlpy.kernels.weights.qweight import PACK_VERSION, PackedWeight
from larqlpy.weights.checkpoint import MappedSafetensors

# the file layout, in the file name (another is stale): 3 the sources' digests, 2 xxh3-64 checksums, 1 CRC32
LAYOUT = 3
FORMAT = f"larqlpy-packed/{LAYOUT}"
DIR = ".larqlpy-cache"
FIELDS = ("codes", "scale", "minimum", "outer")


def cache_dir(model_dir: Path) -> Path:
    """MODEL/.larqlpy-cache, or a directory of this model's own under ~/.cache/larqlpy."""
    here = model_dir / DIR
    if (here.is_dir() and os.access(here, os.W_OK)) or (not here.exists() and os.access(model_dir, os.W_OK)):
        return here
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "larqlpy"
    return home / hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]


def cache_path(model_dir: Path, fmt: str, fingerprint: str) -> Path:
    return cache_dir(model_dir) / f"packed-{fmt}-{fingerprint}-v{PACK_VERSION}.{LAYOUT}.safetensors"


def load_or_build(model_dir: Path, fmt: str, fingerprint: str, sources: dict[str, str],
                  build: Callable[[], dict[str, PackedWeight]]) -> tuple[dict[str, PackedWeight], str]:
    """The packed matrices by name, from the cache when it holds them and was packed from `sources`
    (file name -> digest of the files `build` reads), else built and cached; and where they came
    from: "cache", "built" or "built, not cached (...)"."""
    path = cache_path(model_dir, fmt, fingerprint)
    if path.is_file():
        got = read(path, fmt, fingerprint, sources)
        if got is not None:
            return got, "cache"
    packed = build()
    try:
        write(path, packed, fmt, fingerprint, sources)
    except (OSError, LarqlError) as e:  # a read-only disk costs the cache, not the run
        return packed, f"built, not cached ({e})"
    for old in path.parent.glob(f"packed-{fmt}-*.safetensors"):
        if old != path:
            old.unlink(missing_ok=True)  # stale: another fingerprint or packing version of this model
    return packed, "built"


def write(path: Path, packed: dict[str, PackedWeight], fmt: str, fingerprint: str, sources: dict[str, str]) -> None:
    tensors, matrices = {}, {}
    for name, w in packed.items():
        matrices[name] = w.meta()
        for field in FIELDS:
            t = getattr(w, field)
            if t is not None:
                tensors[f"{name}.{field}"] = t.contiguous().cpu().numpy()
    sums = {k: checksum(a) for k, a in tensors.items()}
    meta = {"format": FORMAT, "weights": fmt, "fingerprint": fingerprint, "pack_version": str(PACK_VERSION),
            "matrices": json.dumps(matrices), "xxh3_64": json.dumps(sums),
            "sources": json.dumps(sources, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def checksum(a) -> int:
    """A tensor's bytes as one 64-bit xxh3 (a buffer: an array or the file's mapped pages)."""
    return xxhash.xxh3_64_intdigest(a)


def read(path: Path, fmt: str, fingerprint: str, sources: dict[str, str]) -> dict[str, PackedWeight] | None:
    """The packed matrices, or None when the file was packed from other bytes than `sources` (stale)."""
    def damaged(why: str) -> LarqlError:
        return LarqlError(f"{path}: damaged packed-weight cache ({why}); delete it and the next load rebuilds it")

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        if (meta.get("format"), meta.get("weights"), meta.get("fingerprint"), meta.get("pack_version")) != \
                (FORMAT, fmt, fingerprint, str(PACK_VERSION)):
            raise damaged("its header names other weights")
        matrices, sums = json.loads(meta["matrices"]), json.loads(meta["xxh3_64"])
        if json.loads(meta["sources"]) != sources:
            return None
        mapped = MappedSafetensors(path)
    except LarqlError:
        raise
    except Exception as e:  # a truncated or garbled file: safetensors and json say so their own way
        raise damaged(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    out = {}
    for name, meta in matrices.items():
        fields = {}
        for field in FIELDS:
            key = f"{name}.{field}"
            if key in sums:
                try:
                    a = mapped.array(key)
                except (KeyError, LarqlError) as e:
                    raise damaged(f"tensor {key}: {e}") from None
                if checksum(a) != sums[key]:
                    raise damaged(f"checksum mismatch in {key}")
                fields[field] = torch.from_numpy(a)
        if "codes" not in fields:
            raise damaged(f"no codes for {name}")
        try:
            out[name] = PackedWeight(meta["kind"], tuple(meta["shape"]), fields["codes"], fields.get("scale"),
                                     fields.get("minimum"), meta["zero"], meta["group"], meta["lowest"],
                                     meta["highest"], fields.get("outer"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise damaged(f"{name}: {type(e).__name__} {e}") from None
    return out
