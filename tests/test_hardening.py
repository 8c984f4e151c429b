"""The cases a hostile but fair user found unclean (issue 28), each driven as that user drove it:
through the CLI in a subprocess, or against a live server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from serving import ENV, EXE, Server, free_port
from tiny import make_tiny

NAME = "smollm2-135m-instruct"


def cli(*args, stdin: bytes | None = None, timeout: int = 300):
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run([*EXE, *argv], input=stdin, capture_output=True, env=ENV, timeout=timeout)


def one_error(r) -> str:
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("larqlpy: error: "), r.stderr.decode()
    assert "Traceback" not in r.stderr.decode()
    return err[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=16)
    return d


# 1. a config.json over another family's weights ------------------------------------------------

def test_a_mislabelled_checkpoint_is_refused_unless_asked(tiny, tmp_path):
    cfg = json.loads((tiny / "config.json").read_text())
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg["vocab_size"],
             "hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
             "num_hidden_layers": cfg["num_hidden_layers"], "num_attention_heads": cfg["num_attention_heads"],
             "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
             "max_position_embeddings": cfg["max_position_embeddings"], "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1}
    shutil.copytree(tiny, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(llama))  # Gemma 3 weights under a Llama config
    line = one_error(cli("run", tmp_path / "m", "the cat", "-n", "4"))
    assert "tensors of its weight files are not used by its family (llama: model.layers.0." in line
    assert "--allow-unused-tensors" in line
    r = cli("run", tmp_path / "m", "the cat", "-n", "4", "--allow-unused-tensors")
    assert r.returncode == 0, r.stderr
    info = json.loads(cli("info", tmp_path / "m", "--json").stdout)
    assert info["unused_tensors"] > 0
    shutil.copytree(tiny, tmp_path / "short")  # fewer layers than the files hold
    (tmp_path / "short" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4,
                                                                "layer_types": cfg["layer_types"][:4]}))
    assert "model.layers.4." in one_error(cli("run", tmp_path / "short", "hi", "-n", "1"))
    assert json.loads(cli("info", tiny, "--json").stdout)["unused_tensors"] == 0


# 3. lone surrogates; 6. roles the templates do not know ------------------------------------------

@pytest.fixture(scope="module")
def server(smol_dir):
    with Server(smol_dir, "--weights", "int8") as s:
        yield s


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800 there"}]}, "'messages'[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "us\udfffer", "content": "hi"}]}, "'messages'[0].role"),
    ("/v1/completions", {"prompt": "\ud800"}, "'prompt'"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\udc80x"]}, "'stop'[0]"),
    ("/v1/completions", {"prompt": "hi", "larqlpy": {"continuation": "\ud800"}}, "'larqlpy'.continuation"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field_and_the_connection_lives_on(server, path, body, field):
    raw = json.dumps({"model": NAME, "max_tokens": 2, **body})  # json.dumps writes the \\ud800 escapes
    with httpx.Client(base_url=server.url, timeout=60) as c:  # one connection for both requests
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["message"].startswith(f"{field}: not valid text (a lone surrogate")
        assert e["type"] == "invalid_request_error"
        ok = c.post("/v1/completions", json={"model": NAME, "prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize("role", ["wizard", "usr", "System"])
def test_a_role_the_templates_do_not_know_is_refused(server, tiny, tmp_path, role):
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": [{"role": role, "content": "hi"}]})
    assert r.status_code == 400 and f"'messages'[0] has the role '{role}'" in r.json()["error"]["message"]
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": [{"role": role, "content": "hi"}]}) + "\n"
                                       + json.dumps({"prompt": "the cat \ud800", "max_tokens": 2}) + "\n")
    out = cli("batch", tiny, tmp_path / "in.jsonl", "--quiet")
    recs = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert out.returncode == 1 and f"has the role '{role}'" in recs[0]["error"]
    assert "`prompt`: not valid text (a lone surrogate U+D800" in recs[1]["error"]
    assert "Traceback" not in out.stderr.decode()


# 4. chat from a pipe ---------------------------------------------------------------------------

def test_chat_from_a_pipe_refuses_a_line_that_is_not_utf8_and_goes_on(smol_dir):
    r = cli("chat", smol_dir, "-n", "4", "--json", "--weights", "int8",
            stdin=b"What is the capital of France?\nthe cat \xff\xfe sat\nAnd of Italy?\n")
    err = r.stderr.decode().strip().splitlines()
    assert err == ["larqlpy: error: line 2: not valid UTF-8 (byte 0xff at byte offset 8)"], r.stderr.decode()
    turns = [json.loads(line) for line in r.stdout.decode().splitlines()]
    assert [t["turn"] for t in turns] == [1, 2] and r.returncode == 1  # a pipe is told something failed


# 5. a port that cannot be had --------------------------------------------------------------------

def test_a_busy_port_or_an_address_not_here_is_refused_before_the_weights_load(tiny):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error(cli("serve", tiny, "--port", port))
    assert line == f"larqlpy: error: cannot listen on 127.0.0.1:{port} (Address already in use)"
    line = one_error(cli("serve", tiny, "--host", "192.0.2.1", "--api-key", "k", "--port", free_port()))
    assert "cannot listen on 192.0.2.1:" in line and "assign requested address" in line
    assert "cannot be resolved" in one_error(cli("serve", tiny, "--host", "no-such-host.invalid", "--api-key", "k"))


# 7. a body cut off halfway -------------------------------------------------------------------------

def test_a_client_that_gives_up_halfway_through_its_body_is_one_line_in_the_log(tiny):
    s = Server(tiny)
    try:
        with socket.create_connection(("127.0.0.1", s.port)) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 1000\r\n\r\n{\"model\": \"tin")
            time.sleep(0.3)
        time.sleep(0.5)
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        log = s.stop()
    lines = [line for line in log.splitlines() if "went away" in line]
    assert len(lines) == 1 and "while sending its request body" in lines[0] and "Traceback" not in log


# 8. outputs that cannot be written ------------------------------------------------------------------

def test_every_output_that_cannot_be_written_is_refused_before_any_work(tiny, tmp_path):
    if os.geteuid() == 0:  # root: os.access says yes to /proc; only making the file tells
        blocked = Path("/proc")
    else:
        blocked = tmp_path / "ro"
        blocked.mkdir()
        blocked.chmod(0o555)
    for args in (["run", tiny, "the cat", "-n", "50", "--save-state", blocked / "s.kv"],
                 ["run", tiny, "the cat", "-n", "50", "--monitor", blocked / "m.csv"],
                 ["run", tiny, "the cat", "-n", "50", "--monitor", tmp_path / "m.csv", "--monitor-plot",
                  blocked / "m.png"],
                 ["batch", tiny, "-", "-o", blocked / "out.jsonl"]):
        r = cli(*args, stdin=b'{"prompt": "the cat"}\n')
        line = one_error(r)
        assert r.stdout == b"" and str(blocked) in line and "cannot be written" in line and ".tmp" not in line, line
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    r = cli("chat", tiny, "-n", "2", "--json", "--chat-template", tmp_path / "t.jinja",
            stdin=f"the cat\n/save {blocked / 'c.kv'}\n/stats\n".encode())
    err = r.stderr.decode().strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"larqlpy: error: /save {blocked / 'c.kv'}: cannot be written")
    assert any("turns" in json.loads(line) for line in r.stdout.decode().splitlines())  # the session went on


def test_a_dead_writers_temp_file_is_swept_at_the_start_of_the_next_command(tiny, tmp_path):
    target = tmp_path / "s.kv"
    stale = tmp_path / ".s.kv.999999.0badc0de.tmp"  # what a kill -9 in the middle of a save leaves
    stale.write_bytes(b"x" * 4096)
    r = cli("run", tiny, "the cat", "-n", "2", "--save-state", target)
    assert r.returncode == 0 and target.is_file() and not stale.exists()
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]


# 2. SIGTERM drains; 9. a client gone during a long prefill -------------------------------------------

LONG = {"model": NAME, "prompt": "Count from 1 to 1000: 1, 2, 3, 4,", "max_tokens": 400, "temperature": 0}


def sse(lines) -> list:
    """The events of a streamed response's lines: dicts, and "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_sigterm_lets_in_flight_streams_finish_and_refuses_new_requests_with_503(smol_dir):
    s = Server(smol_dir, "--weights", "int8", "--shutdown-grace", "120")
    try:
        # 400 tokens: a shorter answer can finish inside the sleep on a fast CPU, and with nothing in
        # flight the server rightly closes its socket (connection refused, not 503)
        with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(6)]
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            refused = httpx.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
            events = sse(iter([*first, *lines]))
        assert refused.status_code == 503 and refused.json()["error"]["message"] == "the server is shutting down"
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        assert len(events[-2]["larqlpy"]["tokens"]) == 400 or events[-2]["choices"][0]["finish_reason"] == "stop"
    finally:
        log = s.stop()
    assert "Traceback" not in log and "CancelledError" not in log


def test_past_the_grace_in_flight_requests_end_properly(smol_dir):
    s = Server(smol_dir, "--weights", "int8", "--shutdown-grace", "1")
    whole = {}
    try:
        t = threading.Thread(target=lambda: whole.update(r=httpx.post(s.url + "/v1/completions", json=LONG,
                                                                      timeout=120)))
        with httpx.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(4)]
            t.start()
            time.sleep(1.0)
            s.proc.send_signal(signal.SIGTERM)
            events = sse(iter([*first, *lines]))
        t.join()
    finally:
        log = s.stop()
    *text, last, error, done = events
    assert done == "[DONE]" and last["choices"][0]["finish_reason"] == "length" and last["larqlpy"]["tokens"]
    assert error["error"]["type"] == "server_error"
    assert "shut down before this answer was complete" in error["error"]["message"]
    assert whole["r"].status_code == 503 and whole["r"].json()["error"]["type"] == "server_error"
    assert "Traceback" not in log and "CancelledError" not in log


def test_a_client_gone_during_a_long_prefill_frees_its_slot_at_once(smol_dir):
    """Its sequence is dropped between prefill chunks, not after the prompt: the state it leaves
    holds only part of the prompt (what a later request with the same prompt finds cached)."""
    words = (Path(__file__).resolve().parent.parent / "larqlpy" / "data" / "long.txt").read_text().split() * 3
    prompt = " ".join(words[:3000])
    with Server(smol_dir, "--weights", "int8") as s:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            time.sleep(0.3)
            r.close()  # gone in the middle of the prefill
        for _ in range(600):
            if httpx.get(s.url + "/health").json()["live"] == 0:
                break
            time.sleep(0.05)
        again = s.post("/v1/completions", {**body, "max_tokens": 1}).json()
    prompt_tokens, cached = again["usage"]["prompt_tokens"], again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens > 2000 and 0 < cached < prompt_tokens - 1024, (cached, prompt_tokens)


# a busy machine ---------------------------------------------------------------------------------

def test_beside_a_busy_process_the_threads_sleep_instead_of_spinning(monkeypatch):
    from larqlpy.kernels import contention

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(os.cpu_count())))
        env = {}
        assert contention.contended() and contention.choose_waits(env) == "PASSIVE"
        assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
        mine = {"GOMP_SPINCOUNT": "1000"}  # the user's own choice stands
        assert contention.choose_waits(mine) is None and mine == {"GOMP_SPINCOUNT": "1000"}
    finally:
        busy.kill()
        busy.wait()


def test_the_kernels_run_on_the_cpus_this_process_may_use(monkeypatch):
    import numba
    import torch

    from larqlpy.kernels.threads import use_cores

    before = torch.get_num_threads(), numba.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # `taskset -c 0`
    try:
        assert use_cores() == 1 and torch.get_num_threads() == 1 and numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(before[0])
        numba.set_num_threads(before[1])


def test_written_files_are_readable_by_others_and_synced_through_their_name(tmp_path):
    """safetensors' save_file renames its own 0600 temp over the path it is given: the files
    atomic_path and atomic_directory put in place are 0644 all the same."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from larqlpy.files import atomic_directory, atomic_path

    one = tmp_path / "one.safetensors"
    with atomic_path(one) as tmp:
        save_file({"a": np.arange(3, dtype=np.float32)}, str(tmp))
    assert oct(one.stat().st_mode & 0o777) == "0o644" and load_file(str(one))["a"].tolist() == [0, 1, 2]
    with atomic_directory(tmp_path / "dir") as d:
        save_file({"b": np.ones(2, np.float32)}, str(d / "model.safetensors"))
        (d / "config.json").write_text("{}")
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / "dir").iterdir()} == \
        {"model.safetensors": "0o644", "config.json": "0o644"}
