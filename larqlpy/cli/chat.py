"""`larqlpy chat MODEL`: a conversation in the terminal or through a pipe, one message per line.

Each reply streams; Ctrl-C stops the reply, not the session. The attention state lives across the
turns: a turn prefills only its own tokens. Commands: /save FILE, /load FILE, /stats, /reset,
/help, /quit. With --json every turn (and /stats, /save) is one JSON line, for scripts.

With --tools, a reply that calls tools shows each call, and the next line (one per call, after a
`result for NAME(ARGS)>` prompt on a terminal) is that call's result; the model then answers the
results. With --n N (or --choices N) a turn makes N answers, all shown; the conversation goes on with the first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from larqlpy.cli.common import (ALLOW_UNUSED, CHAT_TEMPLATE, CONTINUATION, CONTINUATION_OPTION, DEVICE, DRAFT,
                                DRAFT_FIXED, DRAFT_P_MIN, DRAFT_TOKENS, DRAFT_WEIGHTS, DTYPE, ENGINE, KV_DTYPE, LOOKUP,
                                PRE_TOKENIZER, WEIGHTS, err, error_line, fmt_bytes, load_model, read_text, speculation,
                                tool_flags)
from larqlpy.config import GenerationConfig, SamplingConfig
from larqlpy.engines.geometry import check_kv_dtype
from larqlpy.errors import LarqlError
from larqlpy.files import utf8
from larqlpy.text.tools import CallStream

HELP = "/save FILE  /load FILE  /stats  /reset  /help  /quit  (anything else is a message)"


def chat(
    model: Path = typer.Argument(..., help="model directory or .gguf file "
                               "(with a chat template, or give --chat-template)"),
    system: Optional[str] = typer.Option(None, "--system", help="a system message first"),
    chat_template: Optional[Path] = CHAT_TEMPLATE,
    resume_from: Optional[Path] = typer.Option(None, "--resume", help="continue a conversation saved with /save"),
    max_tokens: int = typer.Option(512, "-n", "--max-tokens", help="tokens per reply at most"),
    engine: Optional[str] = ENGINE,
    continuation: Optional[str] = CONTINUATION,
    continuation_option: List[str] = CONTINUATION_OPTION,
    kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="resident KV budget, e.g. 64MiB (cells/v1)"),
    temperature: float = typer.Option(SamplingConfig.temperature, "--temperature", help="0 = greedy"),
    top_k: int = typer.Option(SamplingConfig.top_k, "--top-k", help="0 = off"),
    top_p: float = typer.Option(SamplingConfig.top_p, "--top-p", help="1 = off"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: List[str] = typer.Option([], "--stop", help="end a reply where this text appears (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON line per turn instead of streamed text"),
    tools: Optional[Path] = typer.Option(None, "--tools", help="the tools the model may call, a FILE holding "
                                         "OpenAI's `tools` list (JSON); you give each call's result"),
    tool_choice: Optional[str] = typer.Option(None, "--tool-choice", help="with --tools: auto (default), none, "
                                              "required, or the name of the one function to call, for each "
                                              "message you send (the answer to results: auto)"),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="every answer is JSON valid under "
                                               "this JSON Schema FILE"),
    n_choices: int = typer.Option(1, "--n", "--choices", help="answers per turn (1..16), all shown; the conversation "
                                  "goes on with the first"),
    draft: Optional[Path] = DRAFT,
    draft_tokens: Optional[int] = DRAFT_TOKENS,
    draft_weights: Optional[str] = DRAFT_WEIGHTS,
    draft_p_min: Optional[float] = DRAFT_P_MIN,
    draft_fixed: bool = DRAFT_FIXED,
    lookup: int = LOOKUP,
    device: str = DEVICE,
    dtype: str = DTYPE,
    weights: Optional[str] = WEIGHTS,
    kv_dtype: Optional[str] = KV_DTYPE,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
):
    """Talk to MODEL, keeping the conversation's attention state between turns."""
    from larqlpy.pipeline.request import Request, choices, tools_of

    req = Request.from_dict(dict(prompt="", engine=engine, continuation=continuation, options=list(continuation_option),
                                 kv_budget=kv_budget, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, seed=seed, stop=list(stop), prefill_chunk=GenerationConfig.prefill_chunk,
                                 json_schema=read_text(json_schema, "`json_schema`"),
                                 **speculation(draft, draft_tokens, lookup, draft_p_min, draft_weights, draft_fixed)))
    use, n = tools_of({**tool_flags(tools, tool_choice), "messages": ()}, req.gen), choices({"n": n_choices})
    chosen = engine is not None or continuation is not None or continuation_option or kv_budget is not None
    spec = req.spec().stateful("hold a conversation") if chosen else None  # every refusal before the weights load

    from larqlpy.api.chat import ChatSession
    from larqlpy.cli.compiling import compile_progress
    from larqlpy.text.chat_template import ChatTemplate

    check_kv_dtype(kv_dtype)
    with compile_progress() as progress:  # a GGUF's first load compiles its block decoders
        loaded = load_model(model, device=device, dtype=dtype, weights=weights, kv_dtype=kv_dtype,
                            allow_unused_tensors=allow_unused_tensors, draft=draft, draft_weights=draft_weights,
                            pre_tokenizer=pre_tokenizer)
        template = str(chat_template) if chat_template is not None else None
        ChatTemplate.for_tokenizer(loaded.tokenizer, template)  # a model without one is refused before the first turn
        session = ChatSession(loaded, spec, req.gen, template, system, tools=use, n=n)
        if resume_from is not None:
            session.load(resume_from)
        progress.done()  # no live status under the prompt
        Repl(session, as_json, progress).run()


class Repl:
    def __init__(self, session, as_json: bool, progress=None):
        self.session, self.as_json, self.progress = session, as_json, progress
        self.tty = sys.stdin.isatty()
        self.failed = False
        self.lineno = 0  # lines read from a pipe
        self.fresh = True  # the reply's output is at the start of a line

    def say(self, record: dict, text: str) -> None:
        sys.stdout.write((json.dumps(record) if self.as_json else text) + "\n")
        sys.stdout.flush()

    def read(self) -> str | None:
        """The next line (None at the end of the input); one that is not UTF-8 is refused."""
        if self.tty:
            try:
                return input("> ")
            except EOFError:
                return None
            except UnicodeDecodeError as e:
                raise LarqlError(f"that line is not valid UTF-8 (byte 0x{e.object[e.start]:02x}); "
                                 "the conversation goes on") from None
        self.lineno += 1
        raw = getattr(sys.stdin, "buffer", sys.stdin).readline()
        if not raw:
            return None
        return utf8(raw, f"line {self.lineno}") if isinstance(raw, bytes) else raw

    def run(self) -> None:
        if self.tty and not self.as_json:
            err.print(f"larqlpy chat ({self.session.spec.describe()}); {HELP}", markup=False)
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:  # at the prompt: a fresh line, like a shell
                sys.stdout.write("\n")
                continue
            except LarqlError as e:  # refused; the conversation goes on, as a bad batch line does
                self.failed = True
                err.print(f"larqlpy: error: {error_line(e)}", markup=False, soft_wrap=True)
                continue
            if line is None:
                break
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        break
                else:
                    self.turn(line)
            except LarqlError as e:
                self.failed = True
                err.print(f"larqlpy: error: {error_line(e)}", markup=False, soft_wrap=True)
        raise typer.Exit(1 if self.failed and not self.tty else 0)

    def turn(self, text: str | None, tool_choice=None) -> None:
        """One turn: the reply to `text` (None: to the tool results just given), streamed -- calls
        shown as calls -- then, when it calls tools, their results asked for and answered."""
        s = self.session
        if s.n > 1:
            return self.answers(text)
        pieces, ids, self.fresh = [], [], True
        calls = CallStream(s.tools) if s.tools is not None and s.tools.choice != "none" else None
        try:
            for tok in s.send(text, tool_choice):
                ids.append(tok.id)
                pieces.append(tok.text)
                if not self.as_json:
                    self.show(calls.feed(tok.text) if calls is not None else [tok.text])
        except KeyboardInterrupt:  # stops this reply; the conversation goes on from what it said
            err.print("[reply stopped]", markup=False)
        if calls is not None and not self.as_json:
            self.show(calls.close())
        t, message = s.turns[-1], s.answers[0][0]
        record = {"turn": len(s.turns), "text": "".join(pieces), "tokens": ids, "prompt_tokens": t.prompt_tokens,
                  "prefilled_tokens": t.prefilled_tokens, "finish_reason": t.finish_reason}
        if "tool_calls" in message:
            record.update(finish_reason="tool_calls", tool_calls=message["tool_calls"])
        self.say(record, "")
        if self.progress is not None:
            self.progress.done()  # the kernels this turn compiled, once its answer has ended
        self.results(message)

    def show(self, parts: list) -> None:
        """Reply text as it streams, and each call once whole, on a line of its own."""
        if self.progress is not None:
            self.progress.pause()
        for p in parts:
            text = p if isinstance(p, str) else ("" if self.fresh else "\n") + f"-> {described(p)}\n"
            sys.stdout.write(text)
            self.fresh = text.endswith("\n") if text else self.fresh
        sys.stdout.flush()

    def answers(self, text: str | None) -> None:
        """A turn of several answers (--n), each shown; the conversation goes on with the first."""
        s = self.session
        reply = s.respond(text)
        t = s.turns[-1]
        shown = [f"[{c['index'] + 1}] " + "\n".join([c["content"] or ""] + [f"-> {described(x)}" for x in
                                                                           c.get("tool_calls", ())]).strip()
                 for c in reply["choices"]]
        self.say({"turn": len(s.turns), "choices": reply["choices"], "prompt_tokens": t.prompt_tokens,
                  "generated_tokens": t.generated_tokens}, "\n".join(shown))
        self.results(reply)

    def results(self, message: dict) -> None:
        """Each call's result, a line each (none left: the session ends), then the answer to them."""
        for call in message.get("tool_calls", ()):
            prompt = f"result for {described(call)}> "
            if self.tty:
                try:
                    line = input(prompt)
                except EOFError:
                    line = None
            else:
                line = self.read()
            if line is None:
                return
            self.session.tool_result(call["id"], line.rstrip("\r\n"))
        if message.get("tool_calls"):
            self.turn(None, "auto" if self.session.tools.forced else None)

    def command(self, line: str) -> bool:
        """Run a /command; False to end the session."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        s = self.session
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            self.say({"help": HELP}, HELP)
        elif name == "/stats":
            st = s.stats()
            turns = ", ".join(f"{i + 1}: prefilled {t['prefilled_tokens']} of {t['prompt_tokens']}"
                              for i, t in enumerate(st["turns"]))
            self.say(st, f"engine {st['engine']} | position {st['position']} | resident KV "
                         f"{fmt_bytes(st['resident_kv_bytes'])} | turns: {turns or 'none'}")
        elif name in ("/save", "/load"):
            if not arg:
                raise LarqlError(f"{name} needs a FILE")
            if name == "/save":
                n = s.save(arg, what="/save")
                self.say({"saved": arg, "bytes": n}, f"saved {fmt_bytes(n)} to {arg}")
            else:
                s.load(arg)
                self.say({"loaded": arg, "messages": len(s.messages)}, f"loaded {arg} ({len(s.messages)} messages)")
        elif name == "/reset":
            s.reset()
            self.say({"reset": True}, "conversation cleared")
        else:
            raise LarqlError(f"unknown command {name!r} ({HELP})")
        return True


def described(call: dict) -> str:
    """A call as NAME(ARGUMENTS), the arguments as the model gave them."""
    return f"{call['function']['name']}({call['function']['arguments']})"
