"""Inputs read from files, and grammars, as a hostile prober gave them (issue 60): every file a
flag names is read to its limit and no further (/dev/zero, a FIFO that never ends, a 10 GB file);
a schema nested 10,000 deep, one that nothing can match (`{"$ref": "#"}`) and a regex llguidance
cannot bound (`a{1000000}`) are refused in one line by the CLI, as a 400 by the server and as an
error record by batch, before any work."""

from __future__ import annotations

import io
import json
import os
import subprocess
import threading
import time

import httpx
import pytest
from tokenizers import Tokenizer

from larqlpy.config import Grammar
from larqlpy.decode.constraint import Constraint, Vocabulary, compile_grammar
from larqlpy.errors import LarqlError
from larqlpy.files import TEXT_LIMIT, read_bytes, read_limited
from larqlpy.pipeline.request import Request
from serving import ENV, EXE, Server
from test_hardening import cli, one_error
from tiny import make_tiny

FLAGS = {"--json-schema": [], "--grammar": [], "--tools": ["--chat"], "--chat-template": ["--chat"]}
REF_SELF = {"$ref": "#"}  # nothing can match it: llguidance compiles it, then its first mask fails
UNBOUNDED = "a{1000000}"  # compiles; the first token walks llguidance's lexer past its limit
REFUSED = {"json_schema": "cannot be compiled: no text can match it",
           "regex": "cannot be compiled: lexer error: too many expressions constructed"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=16)
    return d


def endless_fifo(path) -> threading.Thread:
    """A FIFO whose writer never stops (until its reader goes away)."""
    os.mkfifo(path)

    def write():
        try:
            with open(path, "wb") as f:
                while True:
                    f.write(b"{" * 65536)
        except (BrokenPipeError, OSError):
            pass

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


# -- files past their limit ---------------------------------------------------------------------------

@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("source", ["/dev/zero", "sparse", "fifo"])
def test_an_endless_or_huge_file_is_refused_at_its_limit_in_one_line(tiny, tmp_path, flag, source):
    path = tmp_path / "big"
    if source == "sparse":
        with open(path, "wb") as f:
            f.truncate(10 << 30)  # 10 GB that take no disk
    elif source == "fifo":
        endless_fifo(path)
    else:
        path = source
    t0 = time.monotonic()
    line = one_error(cli("run", tiny, "the cat", "-n", "2", *FLAGS[flag], flag, path, timeout=120))
    assert line == f"larqlpy: error: {flag} {path}: larger than 1 MiB, the limit for this input"
    assert time.monotonic() - t0 < 60  # without the limit: until memory runs out


def test_a_read_takes_at_most_one_byte_past_the_limit(tmp_path):
    class Endless(io.RawIOBase):
        given = 0

        def readinto(self, b):
            b[:] = b"x" * len(b)
            self.given += len(b)
            return len(b)

    stream = Endless()
    with pytest.raises(LarqlError, match=r"^stdin: larger than 1,000 bytes, the limit for this input$"):
        read_limited(stream, 1000, "stdin")
    assert stream.given == 1001
    at = tmp_path / "at.txt"
    at.write_bytes(b"x" * TEXT_LIMIT)  # the limit itself is allowed
    assert len(read_bytes(at, "`grammar`")) == TEXT_LIMIT
    at.write_bytes(b"x" * (TEXT_LIMIT + 1))
    with pytest.raises(LarqlError, match="`grammar` .*at.txt: larger than 1 MiB"):
        read_bytes(at, "`grammar`")


def test_stdin_and_a_batch_input_have_their_own_limits(tiny, tmp_path):
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([*EXE, "run", str(tiny), "-", "-n", "2"], stdin=zero, capture_output=True, env=ENV,
                           timeout=120)
    assert one_error(r) == "larqlpy: error: stdin: larger than 64 MiB, the limit for this input"
    big = tmp_path / "in.jsonl"
    with open(big, "wb") as f:
        f.truncate(2 << 30)
    assert one_error(cli("batch", tiny, big)) == f"larqlpy: error: {big}: larger than 1 GiB, the limit for this input"


# -- grammars llguidance refuses or cannot bound --------------------------------------------------------

def test_a_schema_nested_10000_deep_is_one_line_on_the_cli(tiny, tmp_path):
    deep = "{}"
    for _ in range(10_000):
        deep = '{"type": "object", "properties": {"a": ' + deep + "}}"
    (tmp_path / "deep.json").write_text(deep)
    line = one_error(cli("run", tiny, "the cat", "-n", "2", "--json-schema", tmp_path / "deep.json"))
    assert line == "larqlpy: error: --json-schema is not valid JSON (nested too deeply)"
    (tmp_path / "tools.json").write_text("[" * 10_000 + "]" * 10_000)
    line = one_error(cli("run", tiny, "the cat", "--chat", "--tools", tmp_path / "tools.json"))
    assert line == f"larqlpy: error: --tools {tmp_path / 'tools.json'}: not JSON (nested too deeply)"


def test_a_schema_or_tools_nested_deeper_than_json_takes_are_refused_from_the_api():
    deep: dict = {}
    for _ in range(5000):  # a dict, as the Python API takes one: no JSON reader refused it first
        deep = {"a": deep}
    with pytest.raises(LarqlError, match=r"^`json_schema` is not valid JSON \(nested too deeply\)$"):
        Request.from_api("x", json_schema=deep)
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    with pytest.raises(LarqlError, match="^`tools` are nested too deeply$"):
        Request.from_api(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required")


def test_unbounded_grammars_are_one_line_on_the_cli_and_error_records_in_batch(tiny, tmp_path):
    (tmp_path / "ref.json").write_text(json.dumps(REF_SELF))
    line = one_error(cli("run", tiny, "the cat", "-n", "2", "--json-schema", tmp_path / "ref.json"))
    assert line == f"larqlpy: error: --json-schema {REFUSED['json_schema']}"
    line = one_error(cli("run", tiny, "the cat", "-n", "2", "--regex", UNBOUNDED))
    assert line == f"larqlpy: error: --regex {REFUSED['regex']}"
    lines = [{"prompt": "the cat", "max_tokens": 2, "json_schema": REF_SELF},
             {"prompt": "the cat", "max_tokens": 2, "regex": UNBOUNDED},
             {"prompt": "the cat", "max_tokens": 2, "regex": "[a-z]+"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = cli("batch", tiny, tmp_path / "in.jsonl", "--quiet")
    recs = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert r.returncode == 1 and "Traceback" not in r.stderr.decode()
    assert [rec["error"] for rec in recs] == [f"line 1: `json_schema` {REFUSED['json_schema']}",
                                              f"line 2: `regex` {REFUSED['regex']}", None]


def test_unbounded_grammars_are_a_400_with_a_short_message_from_the_server(tiny):
    with Server(tiny) as s:
        model = httpx.get(s.url + "/v1/models").json()["data"][0]["id"]
        for field, shaping in (("response_format", {"response_format": {
                                   "type": "json_schema", "json_schema": {"schema": REF_SELF}}}),
                               ("regex", {"larqlpy": {"regex": UNBOUNDED}})):
            r = s.post("/v1/completions", {"model": model, "prompt": "the cat", "max_tokens": 2, **shaping})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            kind = "json_schema" if field == "response_format" else "regex"
            assert error["message"] == f"'{field}' {REFUSED[kind]}" and error["param"] == field
        ok = s.post("/v1/completions", {"model": model, "prompt": "the cat", "max_tokens": 2})
        assert ok.status_code == 200
        log = s.stop()
    assert "Traceback" not in log


def test_a_grammar_failing_under_way_says_why_in_one_short_line(smol_dir):
    """A sequence's matcher (built without the boundary's walk) fails as llguidance says, without
    the parser state it would append."""
    path = smol_dir / "tokenizer.json"
    aaaa = Tokenizer.from_file(str(path)).token_to_id("aaaa")
    constraint = Constraint(Vocabulary(path.read_text(), 49152, [2]), compile_grammar(Grammar("regex", UNBOUNDED)))
    assert constraint.allowed()[aaaa]
    with pytest.raises(LarqlError) as e:
        constraint.accept(aaaa)
        constraint.allowed()
    assert str(e.value) == "the output grammar failed: lexer error: too many expressions constructed"
