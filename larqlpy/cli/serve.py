"""`larqlpy serve`: the OpenAI-compatible server (larqlpy/server/, docs/serve.md). Flags only: the
server is assembled by `larqlpy.server.serve`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from larqlpy.cli.common import (ALLOW_UNUSED, CONTINUATION, CONTINUATION_OPTION, DEVICE, DRAFT, DRAFT_TOKENS,
                                DRAFT_WEIGHTS, DTYPE, ENGINE, KV_DTYPE, PRE_TOKENIZER, WEIGHTS, err, load_model,
                                model_home, speculation)
from larqlpy.engines.geometry import check_kv_dtype
from larqlpy.config import ServeConfig
from larqlpy.errors import LarqlError

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def serve(
    model: Path = typer.Argument(..., help="model directory (HF layout) or .gguf file"),
    host: str = typer.Option(ServeConfig.host, "--host", help="address to bind (loopback by default)"),
    port: int = typer.Option(ServeConfig.port, "--port"),
    engine: Optional[str] = ENGINE,
    continuation: Optional[str] = CONTINUATION,
    continuation_option: List[str] = CONTINUATION_OPTION,
    parallel: Optional[int] = typer.Option(None, "--parallel", help="sequences decoded together "
                                           "(default: 4 per core, at most 16)"),
    kv_budget: str = typer.Option("512MiB", "--kv-budget", help="KV of live sequences and kept conversation states, "
                                  "all together"),
    disk_budget: str = typer.Option("4GiB", "--disk-budget", help="disk for persisted states; "
                                    "past it the least recently used are evicted"),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="keep states here across restarts "
                                             "(default: a temporary directory)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="LARQLPY_API_KEY", help="require "
                                          "`Authorization: Bearer KEY`"),
    max_tokens_limit: int = typer.Option(ServeConfig.max_tokens_limit, "--max-tokens-limit", help="largest max_tokens "
                                         "a request may ask"),
    max_body: str = typer.Option("1MiB", "--max-body", help="largest request body"),
    shutdown_grace: float = typer.Option(ServeConfig.shutdown_grace_s, "--shutdown-grace",
                                         help="seconds in-flight requests get to finish at SIGTERM"),
    queue_size: int = typer.Option(ServeConfig.queue_size, "--queue-size", help="requests waiting "
                                   "beyond the live ones before 429"),
    pooling: Optional[str] = typer.Option(None, "--pooling", help="/v1/embeddings: pool the final hidden states "
                                          "of the 'last' token (default) or their 'mean'"),
    max_embed_inputs: int = typer.Option(ServeConfig.max_embed_inputs, "--max-embed-inputs", help="inputs one "
                                         "/v1/embeddings request may carry (each waits in the queue as a request)"),
    draft: Optional[Path] = DRAFT,
    draft_tokens: Optional[int] = DRAFT_TOKENS,
    draft_weights: Optional[str] = DRAFT_WEIGHTS,
    device: str = DEVICE,
    dtype: str = DTYPE,
    weights: Optional[str] = WEIGHTS,
    kv_dtype: Optional[str] = KV_DTYPE,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
    ray_address: Optional[str] = typer.Option(None, "--ray", help="serve from replicas on Ray Serve: local | auto | "
                                              "ADDRESS (docs/scale-out.md)"),
    replicas: int = typer.Option(1, "--replicas", help="with --ray: replicas, each a whole server"),
    replica_cpus: int = typer.Option(1, "--replica-cpus", help="with --ray: CPUs per replica (its threads)"),
    min_replicas: Optional[int] = typer.Option(None, "--min-replicas", help="with --ray: autoscale on queue depth, "
                                               "down to this many"),
    max_replicas: Optional[int] = typer.Option(None, "--max-replicas", help="with --ray: autoscale up to this many"),
    worker_model: Optional[str] = typer.Option(None, "--worker-model", help="with --ray: MODEL's path as the "
                                               "replicas see it (default: the same path)"),
):
    """Serve MODEL over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/embeddings,
    /v1/models, /health, /metrics). Conversations' attention states are kept and reused by later requests that
    share their prefix."""
    from larqlpy.files import check_output
    from larqlpy.model.families import read_config

    sizes = _sizes(("--kv-budget", kv_budget), ("--disk-budget", disk_budget), ("--max-body", max_body))
    if state_dir is not None:
        check_output(state_dir, "--state-dir", directory=True)
    cfg = ServeConfig(host=host, port=port, api_key=api_key, max_body_bytes=sizes["--max-body"],
                      max_tokens_limit=max_tokens_limit, queue_size=queue_size, parallel=parallel,
                      kv_budget=sizes["--kv-budget"], disk_budget=sizes["--disk-budget"],
                      state_dir=str(state_dir) if state_dir else None, name=Path(model).resolve().name,
                      engine=engine, continuation=continuation, options=tuple(continuation_option),
                      shutdown_grace_s=shutdown_grace, pooling=pooling, max_embed_inputs=max_embed_inputs)
    read_config(model_home(model, pre_tokenizer))
    check_kv_dtype(kv_dtype)
    speculation(draft, draft_tokens, 0, draft_weights=draft_weights)
    scale = _scale(ray_address, replicas, replica_cpus, min_replicas, max_replicas, worker_model)
    if state_dir is not None:
        state_dir.mkdir(exist_ok=True)
    if host not in LOOPBACK and api_key is None:
        err.print(f"larqlpy: warning: listening on {host} without --api-key: anyone who can reach it may use it",
                  markup=False)
    if ray_address is not None:
        from larqlpy.batch.local import Setup

        setup = Setup(worker_model or str(Path(model).resolve()), device, dtype, weights, kv_dtype, parallel,
                      threads=replica_cpus, allow_unused_tensors=allow_unused_tensors,
                      draft=str(draft) if draft else None, draft_tokens=draft_tokens, draft_weights=draft_weights,
                      pre_tokenizer=pre_tokenizer)
        return _on_ray(ray_address, setup, cfg, scale)

    from larqlpy.cli.compiling import compile_progress
    from larqlpy.server import listen, serve as run_server

    sock = listen(host, port)  # a busy port is refused before the weights load
    with compile_progress(live=False):  # log lines: the first requests compile on the engine's thread
        loaded = load_model(model, device=device, dtype=dtype, weights=weights, kv_dtype=kv_dtype,
                            allow_unused_tensors=allow_unused_tensors, draft=draft, draft_tokens=draft_tokens,
                            draft_weights=draft_weights, pre_tokenizer=pre_tokenizer)
        run_server(loaded, cfg, announce, sock)


def _scale(ray_address, replicas, replica_cpus, min_replicas, max_replicas, worker_model):
    """The replicas `--ray` asks for; every refusal before anything starts."""
    from larqlpy.server.scaling import Scale

    if ray_address is None:
        if (replicas, replica_cpus) != (1, 1) or (min_replicas, max_replicas, worker_model) != (None,) * 3:
            raise LarqlError("--replicas, --replica-cpus, --min-replicas, --max-replicas and --worker-model go "
                             "with --ray")
        return None
    return Scale(replicas, replica_cpus, min_replicas, max_replicas)


def _on_ray(ray_address: str, setup, cfg: ServeConfig, scale) -> None:
    """The replicas on Ray Serve; with `--ray local` and no --state-dir, a temporary directory they
    share (so a turn whose replica died resumes from its file)."""
    import dataclasses
    import shutil
    import tempfile

    from larqlpy.server.ray_serve import serve_on_ray

    tmp = None
    if cfg.state_dir is not None:  # as the replicas see it, whatever their working directory
        cfg = dataclasses.replace(cfg, state_dir=str(Path(cfg.state_dir).resolve()))
    elif ray_address == "local":
        tmp = tempfile.mkdtemp(prefix="larqlpy-replicas-")
        cfg = dataclasses.replace(cfg, state_dir=tmp)
    else:
        err.print("larqlpy: warning: --ray without --state-dir on a shared file system: a turn that lands on "
                  "another replica than its state's is prefilled afresh", markup=False)
    try:
        serve_on_ray(ray_address, setup, cfg, scale, announce_ray)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def announce_ray(s: dict) -> None:
    err.print(f"larqlpy: serving on Ray ({s['address']}: cluster {s['cluster']}, {s['replicas']} replicas, states in "
              f"{s['state_dir'] or 'each replica'}) on {s['url']} (pid {os.getpid()})", markup=False)


def _sizes(*flags: tuple[str, str]) -> dict[str, int]:
    from larqlpy.engines.options import parse_size

    sizes = {}
    for flag, text in flags:
        try:
            sizes[flag] = parse_size(text)
        except ValueError as e:
            raise LarqlError(f"{flag}: {e}") from None
    return sizes


def announce(s: dict) -> None:
    err.print(f"larqlpy: serving {s['name']} ({s['weights']}, KV rows {s['kv_dtype']}, {s['engine']}, "
              f"{s['parallel']} parallel, "
              f"{s['kept']} kept states from {s['state_dir'] or 'nowhere'}) on {s['url']} (pid {os.getpid()})",
              markup=False)
