"""Which replica holds a conversation's state, for a router in front of several servers
(server/ray_serve.py): the keys a request's body gives, and the map from keys to replicas.

A request's keys are hashes of its prefixes, as the body spells them, shortest first:

- messages (chat completions, Anthropic's messages, a Responses `input` of items): one hash per
  message prefix, chained, after a head of what the template renders before them (`system`,
  `instructions`, `tools`): the next turn of a conversation resends the earlier messages, so the
  hash of its prefix that ends where the previous request ended is the previous request's last;
- a completion's `prompt`: one hash per 256 characters (64 ids for a prompt of token ids);
- a Responses chain: `previous_response_id`, mapped to the replica that made that response.

No tokenizer runs here: the server that gets the request matches token ids as it always does; a
key only says where the ids are likely kept. A body that is not JSON has no keys (the server
answers it). The map is an LRU of `most` keys; a key whose replica is gone is skipped.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

CHARS = 256  # a completion prompt's characters per key
IDS = 64  # or its token ids per key
MOST = 200_000


@dataclass(frozen=True)
class Keys:
    prefixes: tuple[str, ...] = ()  # shortest first
    previous: str | None = None  # a Responses request's previous_response_id


def _hash(prev: str, value) -> str:
    return hashlib.blake2b((prev + json.dumps(value, sort_keys=True, ensure_ascii=False)).encode(),
                           digest_size=12).hexdigest()


def _chain(head, items: list) -> tuple[str, ...]:
    out, h = [], _hash("", head)
    for item in items:
        h = _hash(h, item)
        out.append(h)
    return tuple(out)


def _prompt(prompt) -> tuple[str, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tuple(_hash("p", prompt[:n]) for n in range(CHARS, len(prompt) + 1, CHARS))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return tuple(_hash("i", prompt[:n]) for n in range(IDS, len(prompt) + 1, IDS))
    return ()


def keys_of(body: bytes) -> Keys:
    """The routing keys of a request body, whatever route it goes to."""
    try:
        b = json.loads(body)
    except ValueError:
        return Keys()
    if not isinstance(b, dict):
        return Keys()
    head = {k: b.get(k) for k in ("system", "instructions", "tools")}
    previous = b.get("previous_response_id")
    previous = previous if isinstance(previous, str) else None
    if isinstance(b.get("messages"), list):
        return Keys(_chain(head, b["messages"]))
    if previous is not None:  # its input is only the new turn's: the chain is the key
        return Keys(previous=previous)
    if "input" in b:
        items = b["input"]
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        return Keys(_chain(head, items) if isinstance(items, list) else ())
    return Keys(_prompt(b.get("prompt")))


@dataclass
class Affinity:
    """Keys -> the replica that last served them, and how often a request found its replica.
    Thread-safe: a router may run on its own event loop's thread."""

    most: int = MOST
    where: OrderedDict = field(default_factory=OrderedDict)
    counts: dict = field(default_factory=lambda: {"hit": 0, "moved": 0, "new": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, keys: Keys, replica: str, response: str | None = None) -> None:
        """`replica` served a request of `keys` (and made Responses `response`)."""
        with self.lock:
            for k in keys.prefixes + ((f"resp:{response}",) if response else ()):
                self.where[k] = replica
                self.where.move_to_end(k)
            while len(self.where) > self.most:
                self.where.popitem(last=False)

    def known(self, keys: Keys) -> str | None:
        """The replica recorded for the request's longest known key, alive or not."""
        with self.lock:
            if keys.previous is not None:
                return self.where.get(f"resp:{keys.previous}")
            return next((self.where[k] for k in reversed(keys.prefixes) if k in self.where), None)

    def lookup(self, keys: Keys, alive) -> str | None:
        """The replica holding the request's state, if it is among `alive`."""
        replica = self.known(keys)
        return replica if replica in alive else None

    def count(self, keys: Keys, replica: str) -> str | None:
        """A request of `keys` went to `replica`: "hit" (its state's replica), "moved" (its state's
        replica was gone or full), "new" (no state known); None for a request without keys (/health,
        /v1/models: no turn of a conversation)."""
        if not keys.prefixes and keys.previous is None:
            return None
        known = self.known(keys)
        result = "new" if known is None else "hit" if known == replica else "moved"
        with self.lock:
            self.counts[result] += 1
        return result

    def stats(self) -> dict:
        with self.lock:
            counts = dict(self.counts)
        followed = counts["hit"] + counts["moved"]
        return {**counts, "keys": len(self.where), "hit_rate": counts["hit"] / followed if followed else None}


# The process's one map: the front (server/ray_front.py) records into it, the router in the same
# process reads it. Ray ships a router class by value (its module's globals copied), so the router
# reaches this through the module, which is imported, not copied.
SHARED = Affinity()
