"""Chat templates rendered within bounds (issue 60): a template that loops without end or builds a
string of any size is refused in one line (a TemplateBoundError) instead of hanging the CLI or the
server or eating the machine's memory; the server renders off its event loop, so one request stuck
in a template leaves /health, other requests and SIGTERM alone; `serve` refuses such a template at
start. Each case is driven as the probes drove it: the CLI in a subprocess, a live server, or the
template alone in a subprocess whose address space is capped (an unbounded case dies there of a
MemoryError instead of taking the machine)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serving import ENV, EXE, Server, free_port
from tiny import make_tiny
from larqlpy.errors import LarqlError
from larqlpy.text.chat_template import ChatTemplate
from larqlpy.text.template_bounds import Bounds, TemplateBoundError

CAP = 3 * 2**30  # address space: torch's import fits; 'a' * 10**10 does not
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
         "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# the probes: (template, what the refusal says)
PROBES = {
    "nested loops": (LOOP + GEMMA, "rendering took more than 1 s (a loop without end?)"),
    "a power of a power": ("{{ 10**(10**10) }}", "'**' would make an integer of about 40,000,000,000 bits"),
    "a string repeated": ("{{ 'a' * 10**10 }}", "'*' would make 10,000,000,000 characters"),
    "a string doubled in a namespace": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}"
                                        "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
                                        "'+' would make 33,554,432 characters"),
    "lipsum": ("{{ lipsum(10**7) }}", "lipsum() would make 16,000,000,000 characters"),
}


# argv run with its address space capped (exec'd by a small Python: no preexec_fn in a threaded pytest)
CAPPED = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_AS, "
          "(int(sys.argv[1]),) * 2); os.execv(sys.argv[2], sys.argv[2:])"]


def cli(*args, timeout: float = 120):
    return subprocess.run([*CAPPED, str(CAP), *EXE, *map(str, args)], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d)
    return d


@pytest.mark.parametrize("probe", PROBES)
def test_each_probe_is_one_line_and_exit_2_from_run_chat(tiny, tmp_path, probe):
    source, says = PROBES[probe]
    f = tmp_path / "t.jinja"
    f.write_text(source)
    t0 = time.monotonic()
    r = cli("run", tiny, "hi", "--chat", "--chat-template", f, "-n", "1")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert err[0].startswith(f"larqlpy: error: {f}: {says}"), err[0]
    assert time.monotonic() - t0 < 30  # the start of a CLI on a busy 2-core host, and the 1 s bound


# the ways to build a huge string or number beyond the probes: each refused before it is built
FOUND = {
    "str.center": ("{{ 'a'.center(10**10) }}", "str.center() would make"),
    "str.ljust": ("{{ 'a'.ljust(10**10) }}", "str.ljust() would make"),
    "str.zfill": ("{{ 'a'.zfill(10**10) }}", "str.zfill() would make"),
    "str.expandtabs": ("{{ ('\t' * 1000).expandtabs(10**8) }}", "str.expandtabs() would make"),
    "str.replace": ("{{ ('a' * 100000).replace('', 'b' * 100000) }}", "str.replace() would make"),
    "str.join": ("{{ ('x' * 100000).join(range(1000)|map('string')) }}", "str.join() would make"),
    "str.format width": ("{{ '{:10000000000}'.format('a') }}", "str.format() would make"),
    "str.format nested width": ("{{ '{:{w}}'.format('a', w=10**10) }}", "str.format() would make"),
    "% width": ("{{ '%10000000000s' % 'a' }}", "'%' would make"),
    "% star width": ("{{ '%*s' % (10**10, 'a') }}", "'%' would make"),
    "% precision": ("{{ '%.1000000000f' % 1.5 }}", "'%' would make"),
    "int.to_bytes": ("{{ (1).to_bytes(10**10, 'big') }}", "int.to_bytes() would make"),
    "center": ("{{ 'a'|center(10000000000) }}", "the filter 'center' would make"),
    "indent": ("{{ 'a\nb'|indent(10**10) }}", "the filter 'indent' would make"),
    "wordwrap": ("{{ ('a ' * 1000)|wordwrap(1, wrapstring='x' * 100000) }}", "the filter 'wordwrap' would make"),
    "format filter": ("{{ '%10000000000s'|format('a') }}", "the filter 'format' would make"),
    "join filter": ("{{ range(100000)|join('x' * 100000) }}", "the filter 'join' would make"),
    "replace filter": ("{{ ('a' * 100000)|replace('', 'b' * 100000) }}", "the filter 'replace' would make"),
    "batch": ("{{ [1]|batch(10**10, 'x')|list }}", "the filter 'batch' would make"),
    "tojson indent": ("{{ {'a': [1, [2]]}|tojson(indent=10**9) }}", "the filter 'tojson' would make"),
    "a list repeated": ("{{ [1, 2] * 10**10 }}", "'*' would make"),
    "an integer squared": ("{% set ns = namespace(x=10**1000) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                           "{% endfor %}", "'*' would make an integer"),
    "'~' doubling": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                     "'~' would make"),
    "a macro doubling": ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}"
                         "{% endmacro %}{{ d('a', 60) }}", "'~' would make"),
    "a block doubling": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set b %}{{ ns.s }}{{ ns.s }}"
                         "{% endset %}{% set ns.s = b %}{% endfor %}", "a block's output would make"),
    # a list doubled by reference prints (and compares: in C, where no deadline reaches) as a tree
    "two doubled lists compared": ("{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(40) %}"
                                   "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}"
                                   "{{ ns.a == ns.b }}", "a list, tuple or dict would make"),
    "a list doubled by '*'": ("{% set ns = namespace(a=[1]) %}{% for i in range(40) %}{% set ns.a = [ns.a] * 2 %}"
                              "{% endfor %}", "'*' would make"),
    "a list doubled by '+'": ("{% set ns = namespace(a=range(1000)|map('center', 1000)|list) %}"
                              "{% for i in range(40) %}{% set ns.a = ns.a + ns.a %}{% endfor %}", "'+' would make"),
    "varargs doubled": ("{% macro d(n) %}{% if n %}{{ d(n - 1, varargs, varargs) }}{% endif %}{% endmacro %}"
                        "{{ d(40, 1) }}", "a call's arguments would make"),
    "dict() doubled": ("{% set ns = namespace(a=1) %}{% for i in range(40) %}{% set ns.a = dict(x=ns.a, y=ns.a) %}"
                       "{% endfor %}", "a call's arguments would make"),
    "namespace() doubled": ("{% set ns = namespace(a=1) %}{% for i in range(40) %}"
                            "{% set ns.a = namespace(x=ns.a, y=ns.a) %}{% endfor %}", "a call's arguments would make"),
    "dict.fromkeys doubled": ("{% set ns = namespace(a=1) %}{% for i in range(40) %}"
                              "{% set ns.a = dict.fromkeys([1, 2], ns.a) %}{% endfor %}", "dict.fromkeys() would make"),
    "batch's fill doubled": ("{% set ns = namespace(a=[1]) %}{% for i in range(40) %}"
                             "{% set ns.a = [1]|batch(3, ns.a)|list %}{% endfor %}", "the filter 'batch' would make"),
    "one string many times in a list": ("{% set s = 'x' * 1000000 %}{{ ([0] * 1000)|map('default', s, true)|list }}",
                                        "the filter 'list' would make"),
    "a method in a loop": ("{% for i in range(1) %}{{ 'a'.center(10**10) }}{% endfor %}", "str.center() would make"),
    "the output": ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "the output would make"),
    "a macro without end": ("{% macro d() %}{{ d() }}{% endmacro %}{{ d() }}", "recursed past Python's limit"),
    "a loop through a filter": ("{% for i in range(100000) %}{{ range(100000)|select('odd')|list|length }}"
                                "{% endfor %}", "took more than 1 s"),
}
RENDER_ALL = """
import json, sys, time
from larqlpy.errors import LarqlError
from larqlpy.text.chat_template import ChatTemplate
from larqlpy.text.template_bounds import TemplateBoundError
for name, (source, _) in json.loads(sys.stdin.read()).items():
    t0 = time.monotonic()
    try:
        ChatTemplate(source, {}, "T").render([{"role": "user", "content": "hi"}])
        out = "rendered"
    except LarqlError as e:
        out = ("bound: " if isinstance(e, TemplateBoundError) else "error: ") + str(e)
    print(json.dumps([name, out, time.monotonic() - t0]), flush=True)
"""


@pytest.fixture(scope="module")
def found():
    r = subprocess.run([*CAPPED, str(2**30), sys.executable, "-c", RENDER_ALL], input=json.dumps(FOUND),
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return {name: (out, seconds) for name, out, seconds in map(json.loads, r.stdout.splitlines())}


@pytest.mark.parametrize("case", FOUND)
def test_every_other_way_to_a_huge_value_is_refused_before_it_is_built(found, case):
    out, seconds = found[case]
    assert out.startswith("bound: T: ") and FOUND[case][1] in out and "\n" not in out, out
    assert seconds < 3


def test_bounds_are_told_apart_from_the_templates_own_refusals():
    with pytest.raises(TemplateBoundError):
        ChatTemplate("{{ 'a' * 10**10 }}", {}, "T").render([{"role": "user", "content": "hi"}])
    for source in ("{{ raise_exception('no system role') }}", "{{ 1 / 0 }}", "{{ messages[0]['content'] + 1 }}"):
        with pytest.raises(LarqlError) as e:
            ChatTemplate(source, {}, "T").render([{"role": "user", "content": "hi"}])
        assert not isinstance(e.value, TemplateBoundError) and "\n" not in str(e.value)
    ChatTemplate("{{ raise_exception('no system role') }}", {}, "T").check()  # not a bound: serve may start
    with pytest.raises(TemplateBoundError, match="took more than"):
        ChatTemplate(LOOP, {}, "T").check()


def test_a_deadline_passing_as_renders_end_reaches_nothing_after_them_and_locks_nothing():
    """The watchdog's exception lands inside the render it was raised for or not at all: never in
    the code that runs next, nor anywhere that leaves a lock held (the watchdog would wait for ever).
    Renders of about the deadline's length in four threads at once, the GIL passed between them
    often."""
    outcomes, errors = [], []

    def renders(seed: int):
        try:
            for k in range(60):
                n = (seed * 61 + k * 37) % 600 + 1
                source = "{% for i in range(N) %}{% for j in range(100) %}{% endfor %}{% endfor %}ok"
                t = ChatTemplate(source.replace("N", str(n)), {}, "T", Bounds(seconds=0.0007))
                try:
                    outcomes.append(t.render([{"role": "user", "content": "hi"}]))
                except TemplateBoundError:
                    outcomes.append("bound")
                end = time.monotonic() + 0.003  # Python running on past the deadline: a late exception lands here
                while time.monotonic() < end:
                    pass
        except BaseException as e:  # noqa: BLE001 - the watchdog's own exception is a BaseException
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    try:
        threads = [threading.Thread(target=renders, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(outcomes) == 240 and set(outcomes) == {"ok", "bound"}


SPIN = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% if 'spin' in messages[-1]['content'] %}" + LOOP + "{% endif %}" + GEMMA)


@pytest.fixture(scope="module")
def spinning(tmp_path_factory):
    """The tiny model with a template that loops when the last message says 'spin', and that refuses
    a system message (serve must still start: that is the template's own refusal, not a bound)."""
    d = tmp_path_factory.mktemp("spinning")
    make_tiny(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "chat_template": SPIN}))
    return d


def chat(s: Server, text: str, out: dict, key):
    t0 = time.monotonic()
    r = s.post("/v1/chat/completions", {"model": s.name, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": 2}, timeout=60)
    out[key] = (r.status_code, r.json(), time.monotonic() - t0)


def test_a_request_stuck_in_its_template_leaves_the_server_answering_and_sigterm_ends_it(spinning):
    with Server(spinning, "--shutdown-grace", "5") as s:
        s.name, out = spinning.name, {}
        stuck = [threading.Thread(target=chat, args=(s, "spin", out, i)) for i in range(3)]
        for t in stuck:  # three at once: on the event loop they would block it for 3 s, one after another
            t.start()
        time.sleep(0.3)
        waits = []
        for _ in range(4):
            t0 = time.monotonic()
            assert httpx.get(s.url + "/health", timeout=10).status_code == 200
            waits.append(time.monotonic() - t0)
        chat(s, "hello", out, "other")
        for t in stuck:
            t.join()
        assert max(waits) < 1.0, waits
        status, body, _ = out["other"]
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body
        for i in range(3):
            status, body, seconds = out[i]
            assert status == 400 and "rendering took more than 1 s" in body["error"]["message"] and seconds < 10
        # SIGTERM while requests are stuck: the server still drains and ends
        stuck = [threading.Thread(target=chat, args=(s, "spin", out, f"late {i}")) for i in range(2)]
        for t in stuck:
            t.start()
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(timeout=20)
        for t in stuck:
            t.join()
        log = s.proc.stderr.read()
    assert all(out[f"late {i}"][0] in (400, 503) for i in range(2)), out
    assert "Traceback" not in log, log


def test_serve_refuses_a_template_past_the_bounds_at_start(tmp_path):
    d = tmp_path / "looping"
    make_tiny(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "chat_template": LOOP + GEMMA}))
    r = cli("serve", d, "--port", free_port(), timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert err[0] == ("larqlpy: error: the model's chat template: rendering took more than 1 s (a loop without end?); "
                       "the server renders it with a test conversation before it starts"), err
