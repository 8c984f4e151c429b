"""What the CLI's commands share: the consoles, the shared options, and the one place library
parameters become flags (`FLAGS`, `flag`, `cli_text`).

Commands import the library inside their bodies: `larqlpy --help` and every refusal that needs no
weights must not pay for torch.
"""

from __future__ import annotations

import json

import gc
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from larqlpy.errors import LarqlError, spell
from larqlpy.files import PROMPT_LIMIT, is_gguf, read_limited, utf8
from larqlpy.files import read_text as read_file

NO_COLOR = "NO_COLOR" in os.environ
err = Console(stderr=True, no_color=NO_COLOR, highlight=False)
out = Console(no_color=NO_COLOR, highlight=False, width=None if sys.stdout.isatty() else 160)  # pipes: no wrapping

DEVICE = typer.Option("auto", "--device", help="auto | cpu | cuda")
DTYPE = typer.Option("float32", "--dtype", help="float32 | bfloat16")
MONITOR = typer.Option(None, "--monitor", help="sample memory and position into FILE (.csv/.json)")
MONITOR_PLOT = typer.Option(None, "--monitor-plot", help="draw the --monitor samples into a PNG")
WEIGHTS = typer.Option(None, "--weights", help="f32 | bf16 | int8 | int4 | native (each matrix as the GGUF held it): "
                       "weight precision, packed at load; default: what the files hold (native for a .gguf)")
KV_DTYPE = typer.Option(None, "--kv-dtype", help="f32 | f16 | bf16: the dtype exact K/V rows are kept in "
                        "(canonical, window, sinks, exact keys, ACTIVE cells); default: f16, f32 beside --weights f32")
ENGINE = typer.Option(None, "--engine", help="V2 spelling: standard | no-cache | name:k=v,...")
CONTINUATION = typer.Option(None, "--continuation", help="provider identity, e.g. canonical/v1")
CONTINUATION_OPTION = typer.Option([], "--continuation-option", help="key=value (repeatable)")
ALLOW_UNUSED = typer.Option(False, "--allow-unused-tensors",
                            help="load weight files that hold tensors the model's family does not use "
                                 "(refused otherwise: a config.json or a GGUF's metadata over another model's weights)")
PRE_TOKENIZER = typer.Option(None, "--pre-tokenizer", help="a GGUF's text split as this llama.cpp pre-tokenizer "
                             "name does (qwen2, llama3, deepseek-llm, ...), not as its tokenizer.ggml.pre says")
CHAT_TEMPLATE = typer.Option(None, "--chat-template", help="a jinja chat template file instead of the model's")

# Library parameter -> how a CLI user gives it. The library names parameters in backticks
# (larqlpy.errors); only here do they become flags.
FLAGS = {
    "ray_address": "--ray", "options": "--continuation-option", "engine": "--engine", "continuation": "--continuation",
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
    "seed": "--seed", "prefill_chunk": "--prefill-chunk", "kv_budget": "--kv-budget", "resume": "--resume",
    "save_state": "--save-state", "reprefill": "--reprefill", "weights": "--weights", "device": "--device",
    "kv_dtype": "--kv-dtype", "dtype": "--dtype", "monitor": "--monitor", "monitor_plot": "--monitor-plot",
    "force": "--force",
    "positions": "--positions", "budget": "--budget", "plot": "--plot", "calibrate": "`larqlpy calibrate MODEL_DIR`",
    "convert_gguf": "`larqlpy convert-gguf GGUF MODEL_DIR --force`",
    "chat_template": "--chat-template", "parallel": "--parallel", "port": "--port", "api_key": "--api-key",
    "queue_size": "--queue-size", "max_tokens_limit": "--max-tokens-limit", "max_body_bytes": "--max-body",
    "disk_budget": "--disk-budget", "state_dir": "--state-dir", "shard": "--shard",
    "replicas": "--replicas", "replica_cpus": "--replica-cpus", "min_replicas": "--min-replicas",
    "max_replicas": "--max-replicas",
    "shutdown_grace_s": "--shutdown-grace", "host": "--host", "allow_unused_tensors": "--allow-unused-tensors",
    "json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar", "logprobs": "--logprobs",
    "logit_bias": "--logit-bias", "frequency_penalty": "--frequency-penalty", "presence_penalty": "--presence-penalty",
    "repetition_penalty": "--repetition-penalty", "repeat_last_n": "--repeat-last-n", "tools": "--tools",
    "tool_choice": "--tool-choice", "messages": "--chat", "draft_tokens": "--draft-tokens", "lookup": "--lookup",
    "draft_p_min": "--draft-p-min", "draft_weights": "--draft-weights", "pre_tokenizer": "--pre-tokenizer",
    "thinking_budget": "--thinking-budget", "reasoning_effort": "--reasoning-effort", "n": "--n",
    "pooling": "--pooling", "max_embed_inputs": "--max-embed-inputs",
}

# Speculative decoding (docs/speculative.md)
DRAFT = typer.Option(None, "--draft", help="a smaller model of the same vocabulary (directory or .gguf) that "
                     "proposes tokens the model verifies in one pass; the output is the model's own")
DRAFT_TOKENS = typer.Option(None, "--draft-tokens", help="with --draft: tokens proposed per step (default 6)")
DRAFT_WEIGHTS = typer.Option(None, "--draft-weights", help="with --draft: the draft's weights, as --weights "
                             "(default: what its files hold; int4 is packed once into a cache beside it)")
DRAFT_P_MIN = typer.Option(None, "--draft-p-min", help="with --draft: end the proposals at the first token the "
                           "draft gives less than this probability, that token still proposed (default 0.75; "
                           "0: always --draft-tokens)")
DRAFT_FIXED = typer.Option(False, "--draft-fixed", help="with --draft or --lookup: propose every round (default: "
                           "a round proposes where this run measures speculation to let out more tokens per "
                           "second than plain decode)")
LOOKUP = typer.Option(0, "--lookup", help="prompt lookup: propose up to N tokens that followed an earlier "
                      "occurrence of the text's last few tokens (0: off)")

# What shapes the output beyond sampling: a grammar, log-probabilities, penalties and biases (`run`)
JSON_SCHEMA = typer.Option(None, "--json-schema", help="the output is JSON valid under this JSON Schema FILE")
REGEX = typer.Option(None, "--regex", help="the output matches this regular expression")
GRAMMAR = typer.Option(None, "--grammar", help="the output matches this Lark or GBNF grammar FILE")
LOGPROBS = typer.Option(None, "--logprobs", help="with --json: each token's log-probability and the N likeliest "
                        "beside it (0..20)")
LOGIT_BIAS = typer.Option([], "--logit-bias", help="ID=BIAS: add BIAS (-100..100) to that token's logit (repeatable)")
FREQUENCY_PENALTY = typer.Option(0.0, "--frequency-penalty", help="-2..2: minus this x times a token was generated")
PRESENCE_PENALTY = typer.Option(0.0, "--presence-penalty", help="-2..2: minus this for a token generated at all")
REPETITION_PENALTY = typer.Option(1.0, "--repetition-penalty", help="llama.cpp's: tokens among the last "
                                  "--repeat-last-n have a positive logit divided, a negative one multiplied (1: off)")
REPEAT_LAST_N = typer.Option(64, "--repeat-last-n", help="the tokens --repetition-penalty looks back over (-1: all)")
TOOLS = typer.Option(None, "--tools", help="with --chat: the tools the model may call, a FILE holding OpenAI's "
                     "`tools` list (JSON); the calls come back in --json's tool_calls")
THINKING_BUDGET = typer.Option(None, "--thinking-budget", help="with --chat, a model that thinks: close its "
                               "reasoning after N tokens and go on with the answer (0: at once)")
REASONING_EFFORT = typer.Option(None, "--reasoning-effort", help="with --chat: none | minimal (thinking off) | "
                                "low | medium | high (a thinking budget of 1024, 4096, 16384 tokens)")
TOOL_CHOICE = typer.Option(None, "--tool-choice", help="with --tools: auto (default), none, required, or the name "
                           "of the one function to call")


def shaping(json_schema: Optional[Path], regex: Optional[str], grammar: Optional[Path], logprobs: Optional[int],
            logit_bias: list[str], **penalties: float) -> dict:
    """The output-shaping flags as request fields (the files read, each bias parsed), refused in one line."""
    bias = {}
    for item in logit_bias:
        tok, sep, value = item.partition("=")
        try:
            bias[int(tok)] = float(value)
        except ValueError:
            raise LarqlError(f"--logit-bias takes ID=BIAS, e.g. 42=-100; got {item!r}") from None
    return dict(json_schema=read_text(json_schema, "`json_schema`"), regex=regex,
                grammar=read_text(grammar, "`grammar`"), logprobs=logprobs, logit_bias=bias or None, **penalties)


def tool_flags(tools: Optional[Path], tool_choice: Optional[str]) -> dict:
    """--tools and --tool-choice as request fields (the file read as JSON), refused in one line."""
    if tools is None:
        if tool_choice is not None:
            raise LarqlError("--tool-choice needs --tools")
        return {}
    try:
        listed = json.loads(read_text(tools, "`tools`"))
    except ValueError as e:
        raise LarqlError(f"`tools` {tools}: not JSON ({e})") from None
    except RecursionError:
        raise LarqlError(f"`tools` {tools}: not JSON (nested too deeply)") from None
    choice = tool_choice if tool_choice in (None, "auto", "none", "required") else \
        {"type": "function", "function": {"name": tool_choice}}
    return {"tools": listed, "tool_choice": choice}


def read_text(path: Optional[Path], what: str) -> Optional[str]:
    """A small text file a flag names (`what`: its parameter), as text (None: not given), refused in
    one line past files.TEXT_LIMIT."""
    return None if path is None else read_file(path, what)


def flag(name: str) -> str | None:
    return FLAGS.get(name)


def preset_flags(preset: tuple) -> str:
    """A named configuration (engines.presets) as the flags that select it."""
    return f"--continuation {preset[0]} " + " ".join(f"--continuation-option {k}={v}" for k, v in preset[1])


def started() -> None:
    """Start-up is over: what the command has imported and loaded lives until it exits. `entry` keeps
    the garbage collector off until here -- torch's, numba's and the model's imports make hundreds of
    thousands of objects that live as long as the process, and the collector's full passes over them
    while they are made delay a fresh `run`'s first token (docs/benchmarks.md). From here they are
    frozen out of every later pass (the cyclic scraps start-up left stay) and the collector runs as
    usual. Nothing to do where the collector is on (`main` called in-process: the tests, an
    embedder), whose objects are not ours to freeze."""
    if gc.isenabled():
        return
    gc.freeze()
    gc.enable()


def load_model(model: Path, draft: Optional[Path] = None, draft_tokens: Optional[int] = None,
               draft_weights: Optional[str] = None, **kw):
    """`model.loader.load(model, **kw)` on the CPUs this process may use, with its `--draft` model
    beside it, and then start-up is over (`started`); the draft splits text as its own file says."""
    from larqlpy.kernels.threads import use_cores
    from larqlpy.weights.loader import load_with_draft

    use_cores()
    model_home(model, kw.get("pre_tokenizer"))  # a GGUF's metadata, read once, says so
    if draft is not None:
        model_home(draft)
    loaded = load_with_draft(model, draft, draft_tokens, draft_weights, **kw)
    started()
    return loaded


def speculation(draft: Optional[Path], draft_tokens: Optional[int], lookup: int,
                draft_p_min: Optional[float] = None, draft_weights: Optional[str] = None,
                draft_fixed: bool = False) -> dict:
    """The request's speculative decoding flags, checked before any weights load."""
    if draft_fixed and draft is None and not lookup:
        raise LarqlError("--draft-fixed needs --draft or --lookup")
    for flag, value in (("--draft-tokens", draft_tokens), ("--draft-p-min", draft_p_min),
                        ("--draft-weights", draft_weights)):
        if value is not None and draft is None:
            raise LarqlError(f"{flag} needs --draft")
    if draft is not None and lookup:
        raise LarqlError("--draft and --lookup are two ways to propose tokens: give one")
    if draft is not None and not draft.exists():
        raise LarqlError(f"--draft {draft}: no such model")
    from larqlpy.config import GenerationConfig

    given = {k: v for k, v in (("draft_tokens", draft_tokens), ("draft_p_min", draft_p_min)) if v is not None}
    GenerationConfig(lookup=lookup, **given)  # their ranges, as a request's
    return {"lookup": lookup, **given, **({"draft_fixed": True} if draft_fixed else {})}


def model_home(model: Path, pre_tokenizer=...) -> Path:
    """Where MODEL's config.json and tokenizer are: MODEL itself, or a .gguf file's metadata cache
    (made on first use, saying so; pre_tokenizer: as weights.gguf_file.GGUFFile's). gguf-py is
    imported for a GGUF only."""
    if not is_gguf(model) and pre_tokenizer in (None, ...):
        return model  # (a directory given a pre-tokenizer is refused by model_dir)
    from larqlpy.weights.gguf_file import model_dir

    def building(where: Path) -> None:  # on a terminal, as convert-gguf's progress bar
        if err.is_terminal:
            err.print(f"{model}: reading its metadata (tokenizer, chat template, config) once into {where}",
                      markup=False, soft_wrap=True)

    return model_dir(model, building, pre_tokenizer)


def cli_text(text: str) -> str:
    """Library text (an info line, a message) in the CLI's spelling."""
    return spell(text, flag)


def error_line(e: LarqlError) -> str:
    """A refusal as the CLI prints it."""
    return e.render(flag, preset_flags)


def read_prompt(prompt: str, what: str = "PROMPT") -> str:
    """The prompt argument, or stdin for `-`; text that is not UTF-8 is refused, saying where."""
    if prompt == "-":
        stream = getattr(sys.stdin, "buffer", sys.stdin)
        return utf8(read_limited(stream, PROMPT_LIMIT, "stdin"), "stdin")
    return utf8(prompt, what)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def one_engine(command: str, engine, continuation, options) -> list | None:
    """The single engine a command was narrowed to (None: all of them). no-cache holds no rows."""
    from larqlpy.engines import parse_engine_spec

    if engine is None and continuation is None and not options:
        return None
    return [parse_engine_spec(engine, continuation, options).stateful(f"be measured by `larqlpy {command}`")]


class _NoMonitor:
    position = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def monitored(path: Optional[Path], plot: Optional[Path]):
    """A Monitor when --monitor was given, else a stand-in that only holds a position."""
    if path is None:
        return _NoMonitor()
    from larqlpy.tools.monitor import Monitor

    return Monitor(path, plot=plot)


def check_paths(data: Optional[Path], plot: Optional[Path]) -> None:
    from larqlpy.tools.monitor import check_paths as check

    check(data, plot)


def size_flag(value: str, flag: str) -> int:
    """A size flag's bytes (64MiB, 1GB, 4096), or its one-line refusal naming the flag."""
    from larqlpy.engines.options import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise LarqlError(f"{flag}: {e}") from None
