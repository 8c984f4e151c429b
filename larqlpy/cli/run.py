"""`larqlpy run`: one generation, streamed to stdout (or one JSON object)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from larqlpy.cli.common import (ALLOW_UNUSED, CHAT_TEMPLATE, CONTINUATION, CONTINUATION_OPTION, DEVICE, DRAFT,
                                DRAFT_FIXED, DRAFT_P_MIN, DRAFT_TOKENS, DRAFT_WEIGHTS, DTYPE, ENGINE, FREQUENCY_PENALTY,
                                GRAMMAR, JSON_SCHEMA, KV_DTYPE, LOGIT_BIAS, LOGPROBS, LOOKUP, MONITOR, MONITOR_PLOT,
                                PRE_TOKENIZER, PRESENCE_PENALTY, REASONING_EFFORT, REGEX, REPEAT_LAST_N,
                                REPETITION_PENALTY, THINKING_BUDGET, TOOL_CHOICE, TOOLS, WEIGHTS,
                                check_paths, cli_text, err, fmt_bytes, load_model, model_home, monitored, read_prompt,
                                shaping, speculation, tool_flags)
from larqlpy.config import GenerationConfig, SamplingConfig
from larqlpy.engines.geometry import check_kv_dtype
from larqlpy.errors import LarqlError
from larqlpy.files import utf8


def run(
    model: Path = typer.Argument(..., help="model directory (HF layout) or .gguf file"),
    prompt: str = typer.Argument(..., help="prompt text, or - to read stdin ('' with --resume: continue); "
                                          "with --chat, the user's message"),
    max_tokens: int = typer.Option(GenerationConfig.max_tokens, "-n", "--max-tokens", help="tokens to generate "
                                   "at most"),
    engine: Optional[str] = ENGINE,
    continuation: Optional[str] = CONTINUATION,
    continuation_option: List[str] = CONTINUATION_OPTION,
    kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="resident KV budget, e.g. 64MiB (cells/v1)"),
    save_state: Optional[Path] = typer.Option(None, "--save-state", help="write the attention state "
                                              "here after the run"),
    resume_from: Optional[Path] = typer.Option(None, "--resume", help="continue from a saved state file"),
    reprefill: bool = typer.Option(False, "--reprefill", help="with --resume: "
                                   "prefill afresh if the state cannot be trimmed"),
    temperature: float = typer.Option(SamplingConfig.temperature, "--temperature", help="0 = greedy"),
    top_k: int = typer.Option(SamplingConfig.top_k, "--top-k", help="0 = off"),
    top_p: float = typer.Option(SamplingConfig.top_p, "--top-p", help="1 = off"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: List[str] = typer.Option([], "--stop", help="end where this text appears (repeatable); "
                                   "the output stops before it"),
    prefill_chunk: int = typer.Option(GenerationConfig.prefill_chunk, "--prefill-chunk", help="tokens "
                                      "per prefill block"),
    chat: bool = typer.Option(False, "--chat", help="PROMPT is a user message, "
                              "rendered with the model's chat template"),
    system: Optional[str] = typer.Option(None, "--system", help="with --chat: a system message first"),
    chat_template: Optional[Path] = CHAT_TEMPLATE,
    json_schema: Optional[Path] = JSON_SCHEMA,
    regex: Optional[str] = REGEX,
    grammar: Optional[Path] = GRAMMAR,
    logprobs: Optional[int] = LOGPROBS,
    logit_bias: List[str] = LOGIT_BIAS,
    frequency_penalty: float = FREQUENCY_PENALTY,
    presence_penalty: float = PRESENCE_PENALTY,
    repetition_penalty: float = REPETITION_PENALTY,
    repeat_last_n: int = REPEAT_LAST_N,
    tools: Optional[Path] = TOOLS,
    tool_choice: Optional[str] = TOOL_CHOICE,
    thinking_budget: Optional[int] = THINKING_BUDGET,
    reasoning_effort: Optional[str] = REASONING_EFFORT,
    draft: Optional[Path] = DRAFT,
    draft_tokens: Optional[int] = DRAFT_TOKENS,
    draft_weights: Optional[str] = DRAFT_WEIGHTS,
    draft_p_min: Optional[float] = DRAFT_P_MIN,
    draft_fixed: bool = DRAFT_FIXED,
    lookup: int = LOOKUP,
    stats: bool = typer.Option(False, "--stats", help="print engine, speeds and KV bytes to stderr"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming"),
    monitor: Optional[Path] = MONITOR,
    monitor_plot: Optional[Path] = MONITOR_PLOT,
    device: str = DEVICE,
    dtype: str = DTYPE,
    weights: Optional[str] = WEIGHTS,
    kv_dtype: Optional[str] = KV_DTYPE,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
):
    """Generate a continuation of PROMPT."""
    req = run_request(prompt, dict(
        chat=chat, system=system, chat_template=str(chat_template) if chat_template else None, engine=engine,
        continuation=continuation, options=list(continuation_option), kv_budget=kv_budget,
        resume=str(resume_from) if resume_from else None, save_state=str(save_state) if save_state else None,
        reprefill=reprefill, max_tokens=max_tokens, prefill_chunk=prefill_chunk, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, stop=list(stop), thinking_budget=thinking_budget,
        reasoning_effort=reasoning_effort,
        **shaping(json_schema, regex, grammar, logprobs, list(logit_bias), frequency_penalty=frequency_penalty,
                  presence_penalty=presence_penalty, repetition_penalty=repetition_penalty,
                  repeat_last_n=repeat_last_n), **tool_flags(tools, tool_choice),
        **speculation(draft, draft_tokens, lookup, draft_p_min, draft_weights, draft_fixed)))
    check_paths(monitor, monitor_plot)
    check_kv_dtype(kv_dtype)
    from larqlpy.cli.compiling import compile_progress

    with compile_progress() as progress:
        show(generate(model, req, as_json, monitor, monitor_plot, progress, device=device, dtype=dtype,
                      weights=weights, kv_dtype=kv_dtype, allow_unused_tensors=allow_unused_tensors, draft=draft,
                      draft_weights=draft_weights, pre_tokenizer=pre_tokenizer), as_json, stats)


def generate(model: Path, req, as_json: bool, monitor, monitor_plot, progress=None, **load) -> dict:
    """The request's record, its text streamed to stdout as it comes (unless `as_json`); `progress`
    (cli.compiling) hears when the answer starts."""
    from larqlpy.text.tokenizer_process import start

    # the tokenizer loads on another core while torch imports (before it: fork)
    helper = start(model_home(model, load.get("pre_tokenizer")))

    from larqlpy.pipeline.runner import execute

    with monitored(monitor, monitor_plot) as mon:
        loaded = load_model(model, tokenizer=helper, **load)

        def stream(tok):
            mon.position = tok.metrics.position + 1
            if not as_json:
                if progress is not None:
                    progress.pause()
                sys.stdout.write(tok.text)
                sys.stdout.flush()

        return execute(loaded, req, stream)


def run_request(prompt: str, flags: dict):
    """The run's request, every refusal made before the weights load."""
    from larqlpy.pipeline.request import Request

    chat, system = flags.pop("chat"), flags.pop("system")
    if (system is not None or flags["chat_template"] is not None) and not chat:
        raise LarqlError("--system and --chat-template need --chat")
    text = read_prompt(prompt)
    messages = None
    if chat:
        messages = ([{"role": "system", "content": utf8(system, "--system")}] if system is not None else []) + \
            [{"role": "user", "content": text}]
    req = Request.from_dict(dict(prompt="" if chat else text, messages=messages, **flags))
    req.spec()
    return req


def show(result: dict, as_json: bool, stats: bool) -> None:
    result.pop("id")
    result.pop("error")
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    for note in result.get("notes", []):
        err.print(f"larqlpy: note: {cli_text(note)}", markup=False, soft_wrap=True)
    if stats:
        print_stats(result)


def draft_choice_line(c: dict) -> str:
    """What the measured draft length chose, and the figures it chose by."""
    per = ", ".join(f"{'none' if k == '0' else k} {v['rounds']} rounds at {v['tokens_per_s']:.1f} tok/s"
                    for k, v in c["by_length"].items())
    chosen = "none (plain decode)" if c["chosen"] == 0 else str(c["chosen"])
    return f"draft length: {chosen} measured best | {per}"


def print_stats(result: dict) -> None:
    m, session = result["stats"], result.get("session", {})
    extra = ""
    if session.get("resumed_from"):
        extra += f" | resumed {session['reused_tokens']} tok from {session['resumed_from']}"
    if session.get("saved_to"):
        extra += f" | saved {fmt_bytes(session['saved_bytes'])} to {session['saved_to']}"
    err.print(f"engine {result['engine']} | weights {result.get('weights', 'f32')} | "
              f"KV rows {result.get('kv_dtype', 'f32')} | "
              f"prompt {result['prompt_tokens']} tok | prefill "
              f"{m.get('prefill_tokens_per_s', 0):.1f} tok/s | decode {m.get('decode_tokens_per_s', 0):.1f} tok/s | "
              f"resident KV {fmt_bytes(m.get('resident_kv_bytes', 0))} | finish {result['finish_reason']}"
              f"{compiled(m)}{extra}",
              soft_wrap=True, markup=False)
    if result.get("float_fallback"):
        err.print(f"weights: {result['float_fallback']['text']}", soft_wrap=True, markup=False)
    if "target_steps" in m:
        err.print(f"speculative: {m['accepted_tokens']} of {m['proposed_tokens']} proposed tokens accepted "
                  f"({100 * m['acceptance_rate']:.1f}%) | {m['tokens_per_target_step']:.2f} tokens per target step "
                  f"over {m['target_steps']} steps", soft_wrap=True, markup=False)
        if m.get("draft_choice"):
            err.print(draft_choice_line(m["draft_choice"]), soft_wrap=True, markup=False)
    if "transitions" in result:
        cells = ", ".join(f"{k} {v}" for k, v in sorted(result["cells"].items()))
        moves = ", ".join(f"{t['event']} {t['from']}->{t['to']} x{t['count']}" for t in result["transitions"])
        err.print(f"cells: {cells} | transitions: {moves}", soft_wrap=True, markup=False)


def compiled(stats: dict) -> str:
    """The stats line's part for kernels compiled inside the run (none on a warm cache)."""
    took = stats.get("compile_seconds", 0)
    return f" | compile {took:.1f} s (once)" if took else ""
