"""The Responses API's stored responses (`store: true`, the default): what GET /v1/responses/{id}
returns, and the conversation a later response that names it as `previous_response_id` continues.

The attention state of a chain is not here: each response's state goes to the server's kept
states (state/prefix_cache.py) like every request's, in the same KV budget, and the next response
of the chain finds it there by its token ids. What is stored here is the conversation as messages
(its input items and output, without its instructions, which a chain does not carry over), so a
chain whose state was evicted or lost is rebuilt from them by a prefill.

The newest `memory` responses stay in memory. With a state directory every one is also written to
`<state_dir>/responses/<id>.json` (atomically) and read back on demand, so chains survive a restart;
past `most` files the oldest go first.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write, read_bytes, remove_stale

ID = re.compile(r"^resp_[0-9a-f]{32}$")  # checked before an id names a file
FORMAT = "larqlpy-response/1"
MEMORY = 1024
MOST = 100_000
LIMIT = 64 << 20  # a stored file read back: a conversation past this was never written by this server


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object, as GET returns it
    messages: tuple[dict, ...]  # its conversation as the chat template takes it, its own answer last


def new_id() -> str:
    return "resp_" + secrets.token_hex(16)


class ResponseStore:
    def __init__(self, state_dir: str | Path | None = None, memory: int = MEMORY, most: int = MOST):
        self.dir = Path(state_dir) / "responses" if state_dir is not None else None
        self.memory, self.most = memory, most
        self.recent: OrderedDict[str, Stored] = OrderedDict()
        self.lock = threading.Lock()  # puts and gets come from the preparing pool's threads
        self.files = 0
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            remove_stale(self.dir, r".*\.json.*\.tmp")
            self.files = sum(1 for _ in self.dir.glob("resp_*.json"))

    def put(self, rid: str, stored: Stored) -> None:
        """Keep `stored` under `rid` (its file written before this returns: a chain's next request
        may name it at once)."""
        with self.lock:
            self.recent[rid] = stored
            self.recent.move_to_end(rid)
            while len(self.recent) > self.memory:
                self.recent.popitem(last=False)
        if self.dir is None:
            return
        with atomic_write(self._path(rid), "a stored response") as f:
            f.write(json.dumps({"format": FORMAT, "response": stored.response,
                                "messages": list(stored.messages)}, ensure_ascii=False).encode())
        with self.lock:
            self.files += 1
            if self.files > self.most:
                self._trim()

    def get(self, rid: str) -> Stored | None:
        """The response stored under `rid`; None when there is none (never stored, deleted, gone
        past the limits, or not an id this server makes)."""
        if not ID.match(rid):
            return None
        with self.lock:
            if rid in self.recent:
                self.recent.move_to_end(rid)
                return self.recent[rid]
        path = self._path(rid) if self.dir is not None else None
        if path is None or not path.is_file():
            return None
        try:
            raw = json.loads(read_bytes(path, "a stored response", LIMIT))
        except (LarqlError, ValueError) as e:
            raise LarqlError(f"the stored response '{rid}' cannot be read ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("response"), dict) \
                or not isinstance(raw.get("messages"), list):
            raise LarqlError(f"the stored response '{rid}' is not one this server wrote ({FORMAT})")
        return Stored(raw["response"], tuple(raw["messages"]))

    def delete(self, rid: str) -> bool:
        if not ID.match(rid):
            return False
        with self.lock:
            found = self.recent.pop(rid, None) is not None
        if self.dir is not None and self._path(rid).is_file():
            self._path(rid).unlink(missing_ok=True)
            with self.lock:
                self.files -= 1
            found = True
        return found

    def _path(self, rid: str) -> Path:
        return self.dir / f"{rid}.json"

    def _trim(self) -> None:
        """The oldest files, past `most`."""
        files = sorted(self.dir.glob("resp_*.json"), key=lambda p: p.stat().st_mtime)
        for p in files[:max(0, len(files) - self.most)]:
            p.unlink(missing_ok=True)
        self.files = min(len(files), self.most)
