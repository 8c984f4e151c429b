"""A .gguf file as a model: run directly, with no conversion and no float32 copy.

The first load reads the file's metadata once with gguf-py and writes what a model directory holds
beside the weights -- config.json, generation_config.json, tokenizer.json, tokenizer_config.json --
into its metadata cache, `FILE.gguf.larqlpy/` beside the file (or `~/.cache/larqlpy/gguf/KEY/` where
the folder is read-only), with `gguf.json`: the file's identity, the digest of its header and the
tensor table (name, type, shape, offset). Later loads read the table from there and never parse the
header again while the file keeps its identity (weights/known_files.py's test); a file with another
identity but the same header bytes keeps the cache, and one with another header rebuilds it. The
metadata cache is also the model's directory for everything else kept beside a model: the key
calibration and `.larqlpy-cache/`.
The tensors themselves: weights/gguf_checkpoint.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_directory, atomic_write, is_gguf
from larqlpy.weights.checkpoint import SAMPLE
from larqlpy.weights.gguf_archs import ARCHS, Arch, expert_views
from larqlpy.weights.gguf_meta import read_gguf, write_metadata
from larqlpy.weights.gguf_pretok import check_name
from larqlpy.weights.gguf_tokenizer import build_tokenizer
from larqlpy.weights.known_files import identity

SUFFIX = ".larqlpy"
RECORD = "gguf.json"
FORMAT = "larqlpy-gguf/3"  # 2: made only after the header passed weights/gguf_check.py; 3: llama.cpp's pre-tokenizers


def metadata_dir(file: Path) -> Path:
    """FILE.gguf.larqlpy beside the file, or a directory of this file's own under ~/.cache/larqlpy/gguf
    when the folder cannot be written."""
    here = file.with_name(file.name + SUFFIX)
    if (here.is_dir() and os.access(here, os.W_OK)) or (not here.exists() and os.access(file.parent, os.W_OK)):
        return here
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "larqlpy" / "gguf"
    return home / hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:16]


def model_dir(path: str | os.PathLike, building: Callable[[Path], None] | None = None, pre_tokenizer=...) -> Path:
    """The directory holding a model's config.json and tokenizer: the path itself, or a GGUF file's
    metadata cache (made on first use, after `building` is told where; pre_tokenizer as GGUFFile's)."""
    gguf = open_gguf(path, building, pre_tokenizer)
    return Path(path) if gguf is None else gguf.dir


def open_gguf(path: str | os.PathLike, building: Callable[[Path], None] | None = None,
              pre_tokenizer=...) -> GGUFFile | None:
    """The GGUF file at `path` (GGUFFile), or None for a model directory, which takes no pre_tokenizer."""
    path = Path(path)
    if is_gguf(path):
        return GGUFFile(path, building, pre_tokenizer)
    if pre_tokenizer not in (None, ...):
        raise LarqlError(f"{path}: `pre_tokenizer` names how a GGUF file's text splits; a directory's "
                         "tokenizer.json says how its text does")
    return None


def _header_digest(file: Path, header_bytes: int) -> str:
    """sha256 of the header (metadata and tensor table), a sample from each end of the tensor data,
    and the size: what the fingerprint and the metadata cache's validity rest on."""
    size = file.stat().st_size
    h = hashlib.sha256()
    with open(file, "rb") as f:
        h.update(f.read(header_bytes))
        h.update(f.read(SAMPLE))
        f.seek(max(header_bytes, size - SAMPLE))
        h.update(f.read(SAMPLE))
    h.update(str(size).encode())
    return h.hexdigest()


class GGUFFile:
    """One GGUF file: its metadata cache (made or checked here) and its tensor table."""

    def __init__(self, path: Path, building: Callable[[Path], None] | None = None, pre_tokenizer=...):
        """building: told the metadata cache's directory before the header is read to make it (a
        few seconds for a large vocabulary). pre_tokenizer: a llama.cpp pre-tokenizer name that splits
        text instead of the file's tokenizer.ggml.pre, None for the file's own, ... for whichever the
        cache was made with; the cache is made again when it was made with another."""
        self.path = Path(path)
        self.dir = metadata_dir(self.path)
        if pre_tokenizer not in (None, ...):
            check_name(pre_tokenizer)
        record = self._cached()
        if record is not None and pre_tokenizer is not ... and record.get("pre_tokenizer") != pre_tokenizer:
            record = None
        if record is None:
            if building is not None:
                building(self.dir)
            record = self._build(None if pre_tokenizer is ... else pre_tokenizer)
        self.pre_tokenizer: str | None = record.get("pre_tokenizer")  # given in place of the file's
        self.splits_as: str | None = record.get("splits_as")  # the pre-tokenizer in use (byte-level BPE)
        self.arch: Arch = ARCHS[record["arch"]]
        self.digest: str = record["digest"]
        self.fingerprint = self.digest[:16]
        self.header_bytes = int(record["header_bytes"])
        # gguf name -> (type name, shape (out, in) as numpy lays it out, absolute offset, bytes); a layer's
        # experts as one view an expert, `NAME[j]` (gguf_archs.expert_views), as the arch's names read them
        self.tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = expert_views({
            k: (t, tuple(s), int(o), int(n)) for k, (t, s, o, n) in record["tensors"].items()})
        if self.arch.table is not None:
            self.tensors = self.arch.table(self.tensors)

    def _cached(self) -> dict | None:
        """The record, when it holds for the file as it is now (rewritten with the new identity when
        only that changed)."""
        try:
            record = json.loads((self.dir / RECORD).read_text())
            if record.get("format") != FORMAT or record.get("arch") not in ARCHS:
                return None
            ident = identity(self.path)
            if record["identity"] == ident:
                return record
            if _header_digest(self.path, int(record["header_bytes"])) != record["digest"]:
                return None
            record["identity"] = ident
            with atomic_write(self.dir / RECORD) as f:
                f.write(json.dumps(record).encode())
            return record
        except (OSError, ValueError, KeyError, TypeError, LarqlError):
            return None

    def _build(self, pre_tokenizer: str | None) -> dict:
        """Read the whole header once with gguf-py, checked (tensors inside the file among the rest),
        and write the metadata cache."""
        meta, arch = read_gguf(self.path, pre_tokenizer)
        config = arch.config(meta)
        tokenizer = build_tokenizer(meta)
        header = int(meta.reader.data_offset)
        tensors = {t.name: (t.tensor_type.name, [int(d) for d in reversed(t.shape)], int(t.data_offset), int(t.n_bytes))
                   for t in meta.reader.tensors}
        record = {"format": FORMAT, "arch": arch.name, "identity": identity(self.path), "header_bytes": header,
                  "digest": _header_digest(self.path, header), "tensors": tensors, "pre_tokenizer": pre_tokenizer,
                  "splits_as": meta.get("tokenizer.ggml.pre", "default") if meta.get("tokenizer.ggml.model") == "gpt2"
                  else None}
        try:
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            with atomic_directory(self.dir, replace=True) as tmp:
                write_metadata(tmp, config, *tokenizer)
                (tmp / RECORD).write_text(json.dumps(record))
        except OSError as e:
            raise LarqlError(f"{self.path}: cannot write its metadata cache {self.dir} ({e.strerror})") from None
        return record
