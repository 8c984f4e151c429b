"""Conversations against a live `larqlpy serve`, alone or on Ray (`--ray local`): the server started
as a subprocess (its URL and Ray cluster read from its announcement), conversations of several
turns through the `openai` client, and a replica killed mid-run. Used by tests/test_serve_ray.py and
bench/serve_ray.py."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from serving import free_port

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
CLUSTER = re.compile(r"cluster (\S+),")
TOPICS = ["oceans", "volcanoes", "bread", "bicycles", "comets", "bees", "glass", "rivers", "clocks", "deserts",
          "violins", "forests", "bridges", "tea", "maps", "whales"]
FOLLOW_UPS = ["Tell me one more fact.", "Why does that matter?", "Say it more simply.", "Give an example."]


class Launched:
    """A `larqlpy serve` subprocess: its URL, and its Ray cluster's address when it runs one."""

    def __init__(self, model: str, *args: str, env: dict | None = None, timeout: float = 600):
        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "larqlpy.cli.main", "serve", model, "--port", str(port),
                                      *args], env={**ENV, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        self.url, self.cluster = f"http://127.0.0.1:{port}", None
        deadline = time.monotonic() + timeout
        self.ready.wait(timeout)
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:  # announced before it listens
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.25)
        self.stop()
        raise RuntimeError("larqlpy serve did not come up:\n" + "".join(self.lines[-20:]))

    def _read(self) -> None:
        announced = ""
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("larqlpy: serving") or announced:
                announced += line  # the announcement may wrap
                if "(pid" in announced:
                    m = CLUSTER.search(announced.replace("\n", ""))
                    self.cluster = m.group(1) if m else None
                    self.ready.set()
                    announced = ""
        self.ready.set()  # it exited

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Turn:
    text: str
    prompt: int
    completion: int
    cached: int
    ttft: float | None


async def conversation(client, model: str, i: int, turns: int, max_tokens: int, stream: bool,
                       progress: list) -> list[Turn | str]:
    """Conversation `i`: its turns, or an error's text where one failed (the conversation stops)."""
    messages = [{"role": "system", "content": f"Conversation {i}. Answer in one short sentence."},
                {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
    out: list[Turn | str] = []
    for t in range(turns):
        t0 = time.perf_counter()
        kw = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        try:
            if stream:
                text, first, usage = "", None, None
                async for chunk in await client.chat.completions.create(
                        **kw, stream=True, stream_options={"include_usage": True}):
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first if first is not None else time.perf_counter() - t0
                        text += chunk.choices[0].delta.content
                    usage = chunk.usage or usage
            else:
                r = await client.chat.completions.create(**kw)
                text, first, usage = r.choices[0].message.content, None, r.usage
        except Exception as e:  # a failed request is counted, not raised
            out.append(f"{type(e).__name__}: {e}")
            return out
        out.append(Turn(text, usage.prompt_tokens, usage.completion_tokens,
                        usage.prompt_tokens_details.cached_tokens, first))
        progress.append((i, t))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UPS[t % 4]}]
    return out


def replica_killer(cluster: str):
    """Joins the cluster now (a second or so), and returns what kills one replica at once."""
    import ray

    ray.init(address=cluster, log_to_driver=False)

    def kill() -> str:
        try:
            names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                           if "#replica#" in a["name"])
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            return names[0]
        finally:
            ray.shutdown()
    return kill


async def converse(server: Launched, model: str, ids, turns: int, max_tokens: int, stream: bool,
                   kill_after: int | None = None) -> tuple[list[list], str | None]:
    """Conversations `ids` at once; with `kill_after`, one replica killed once that many turns are in.
    Each conversation's turns (an error's text where one failed), and the replica killed."""
    from openai import AsyncOpenAI

    progress: list = []
    kill = await asyncio.to_thread(replica_killer, server.cluster) if kill_after is not None else None

    async def killer():
        while len(progress) < kill_after:
            await asyncio.sleep(0.01)
        return await asyncio.to_thread(kill)

    killing = asyncio.create_task(killer()) if kill is not None else None
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        convs = await asyncio.gather(*(conversation(client, model, i, turns, max_tokens, stream, progress)
                                       for i in ids))
    if killing is not None and not killing.done():  # the run ended (or failed) first
        killing.cancel()
        return list(convs), None
    return list(convs), await killing if killing is not None else None
