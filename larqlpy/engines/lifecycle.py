"""The KV cell state machine of cells/v1: states, events, and transition rules loaded from YAML.

Rules files are validated on load; every error names the file and the line. A transition the
engine asks for that no rule allows raises `IllegalTransition` -- never silently skipped.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from larqlpy.engines.options import check_width, parse_layer_bits
from larqlpy.errors import LarqlError
from larqlpy.files import read_text


class State(str, enum.Enum):
    NONE = "NONE"  # before a cell exists (the `from` of TOKEN_APPEND)
    ACTIVE = "ACTIVE"  # f32 rows in memory
    QUANTIZED = "QUANTIZED"  # codec codes in memory
    PERSISTED = "PERSISTED"  # in the cell store on disk, read through mmap; not resident
    EVICTED = "EVICTED"  # freed: below every reader's horizon
    RECOVERING = "RECOVERING"  # being brought back from disk for a read


class Event(str, enum.Enum):
    TOKEN_APPEND = "TOKEN_APPEND"
    MEMORY_PRESSURE = "MEMORY_PRESSURE"
    READ_REQUEST = "READ_REQUEST"
    CACHE_MISS = "CACHE_MISS"
    WRITE_BACK = "WRITE_BACK"
    EVICT = "EVICT"


class IllegalTransition(LarqlError):
    pass


# What the engine must be able to do whatever the policy: create cells, read them, drop them.
REQUIRED = [
    (Event.TOKEN_APPEND, State.NONE, State.ACTIVE),
    (Event.READ_REQUEST, State.ACTIVE, State.ACTIVE),
    (Event.EVICT, State.ACTIVE, State.EVICTED),
]


@dataclass(frozen=True)
class Policy:
    keep_active_recent: int = 128
    quantize_layers: tuple[int, ...] | None = None  # None: all layers
    bits: int = 4
    k_bits: int | None = None  # None: `bits`
    v_bits: int | None = None
    layer_bits: tuple[tuple[int, tuple[int, int] | None], ...] = ()  # per layer: (K, V) widths, None: exact
    calib: bool = False  # QUANTIZED keys as (k - mean) * scale with the model's key calibration

    def may_quantize(self, layer: int) -> bool:
        if dict(self.layer_bits).get(layer, ()) is None:
            return False
        return self.quantize_layers is None or layer in self.quantize_layers

    def widths(self, layer: int) -> tuple[int, int]:
        """(K bits, V bits) of this layer's QUANTIZED cells."""
        w = dict(self.layer_bits).get(layer)
        return w if w is not None else (self.k_bits or self.bits, self.v_bits or self.bits)


@dataclass
class Rules:
    source: str
    cell_size: int
    policy: Policy
    allowed: frozenset[tuple[Event, State, State]]
    counts: Counter = field(default_factory=Counter)

    def allows(self, event: Event, src: State, dst: State) -> bool:
        return (event, src, dst) in self.allowed

    def target(self, event: Event, src: State, preferred: tuple[State, ...]) -> State | None:
        """The first of `preferred` that a rule allows for (event, src), or None."""
        return next((dst for dst in preferred if self.allows(event, src, dst)), None)

    def apply(self, event: Event, src: State, dst: State) -> State:
        if not self.allows(event, src, dst):
            raise IllegalTransition(f"illegal transition {event.value}: {src.value} -> {dst.value} "
                                    f"(no rule in {self.source})")
        self.counts[(event.value, src.value, dst.value)] += 1
        return dst

    def counted(self) -> list[dict]:
        return [{"event": e, "from": s, "to": d, "count": n} for (e, s, d), n in sorted(self.counts.items())]

    def can_reach_disk(self) -> bool:
        """Whether memory pressure can take an ACTIVE cell out of memory (directly or via QUANTIZED)."""
        mp = Event.MEMORY_PRESSURE
        return self.allows(mp, State.ACTIVE, State.PERSISTED) or (
            self.allows(mp, State.ACTIVE, State.QUANTIZED) and self.allows(mp, State.QUANTIZED, State.PERSISTED))


def default_rules_path() -> Path:
    return Path(str(resources.files("larqlpy.engines").joinpath("default_rules.yaml")))


def load_rules(path: str | Path | None = None) -> Rules:
    path = Path(path) if path is not None else default_rules_path()
    return parse_rules(read_text(path, "rules file"), str(path))


def parse_rules(text: str, source: str = "<rules>") -> Rules:
    def err(node, msg: str) -> LarqlError:
        line = node.start_mark.line + 1 if node is not None else 1
        return LarqlError(f"{source}:{line}: {msg}")

    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise LarqlError(f"{source}:{line}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(root, yaml.MappingNode):
        raise err(root, "expected a mapping with version, cell_size, policy and rules")
    top = {k.value: v for k, v in root.value}
    unknown = set(top) - {"version", "cell_size", "policy", "rules"}
    if unknown:
        key = next(k for k, _ in root.value if k.value in unknown)
        raise err(key, f"unknown key {key.value!r} (expected version, cell_size, policy, rules)")
    if "version" in top and _scalar(top["version"]) != 1:
        raise err(top["version"], f"unsupported rules version {top['version'].value!r} (expected 1)")
    cell_size = _int(top.get("cell_size"), 64, err, "cell_size", lo=1)
    policy = _policy(top.get("policy"), err)
    if "rules" not in top or not isinstance(top["rules"], yaml.SequenceNode) or not top["rules"].value:
        raise err(top.get("rules", root), "rules: expected a non-empty list of {event, from, to}")
    allowed = set()
    for item in top["rules"].value:
        if not isinstance(item, yaml.MappingNode):
            raise err(item, "a rule must be a mapping {event, from, to}")
        fields = {k.value: v for k, v in item.value}
        if set(fields) != {"event", "from", "to"}:
            raise err(item, f"a rule needs exactly event, from, to (got {', '.join(sorted(fields)) or 'nothing'})")
        ev = _enum(Event, fields["event"], err, "event")
        src = _enum(State, fields["from"], err, "state")
        dst = _enum(State, fields["to"], err, "state")
        if dst == State.NONE:
            raise err(fields["to"], "no rule may lead to NONE")
        if src == State.NONE and ev != Event.TOKEN_APPEND:
            raise err(fields["from"], "only TOKEN_APPEND starts from NONE")
        if (ev, src, dst) in allowed:
            raise err(item, f"duplicate rule {ev.value}: {src.value} -> {dst.value}")
        allowed.add((ev, src, dst))
    rules = Rules(source, cell_size, policy, frozenset(allowed))
    missing = [f"{e.value}: {s.value} -> {d.value}" for e, s, d in REQUIRED if (e, s, d) not in allowed]
    # a cell that can reach a state must be able to be evicted and read from it
    for st in (State.QUANTIZED, State.PERSISTED):
        if any(d == st for _, _, d in allowed):
            if (Event.EVICT, st, State.EVICTED) not in allowed:
                missing.append(f"EVICT: {st.value} -> EVICTED")
    if any(d == State.QUANTIZED for _, _, d in allowed) and \
            (Event.READ_REQUEST, State.QUANTIZED, State.QUANTIZED) not in allowed:
        missing.append("READ_REQUEST: QUANTIZED -> QUANTIZED")
    if any(d == State.PERSISTED for _, _, d in allowed):
        for need in ((Event.CACHE_MISS, State.PERSISTED, State.RECOVERING),
                     (Event.WRITE_BACK, State.RECOVERING, State.PERSISTED)):
            if need not in allowed:
                missing.append(f"{need[0].value}: {need[1].value} -> {need[2].value}")
    if missing:
        raise err(top["rules"], "rules: missing transitions the engine needs: " + "; ".join(missing))
    return rules


def _scalar(node):
    return yaml.safe_load(yaml.serialize(node)) if node is not None else None


def _int(node, default, err, name, lo=0):
    if node is None:
        return default
    v = _scalar(node)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise err(node, f"{name} must be an integer >= {lo}, got {node.value!r}")
    return v


def _enum(cls, node, err, what):
    value = node.value if isinstance(node, yaml.ScalarNode) else None
    try:
        return cls(value)
    except ValueError:
        raise err(node, f"unknown {what} {value!r} (known: {', '.join(m.value for m in cls)})") from None


def _policy(node, err) -> Policy:
    if node is None:
        return Policy()
    if not isinstance(node, yaml.MappingNode):
        raise err(node, "policy must be a mapping")
    fields = {k.value: (k, v) for k, v in node.value}
    known = ("keep_active_recent", "quantize_layers", "bits", "k_bits", "v_bits", "layer_bits", "calib")
    unknown = set(fields) - set(known)
    if unknown:
        key = fields[sorted(unknown)[0]][0]
        raise err(key, f"unknown policy key {key.value!r} (expected {', '.join(known)})")
    keep = _int(fields.get("keep_active_recent", (None, None))[1], 128, err, "keep_active_recent")
    bits = _int(fields.get("bits", (None, None))[1], 4, err, "bits", lo=3)
    if bits not in (3, 4):
        raise err(fields["bits"][1], f"bits must be 3 or 4, got {bits}")
    layers_node = fields.get("quantize_layers", (None, None))[1]
    layers: tuple[int, ...] | None = None
    if layers_node is not None:
        v = _scalar(layers_node)
        if v == "all":
            layers = None
        elif v == "none":
            layers = ()
        elif isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v):
            layers = tuple(v)
        else:
            raise err(layers_node, "quantize_layers must be all, none, or a list of layer indices")
    widths = {}
    for name in ("k_bits", "v_bits"):
        node_w = fields.get(name, (None, None))[1]
        if node_w is not None:
            try:
                widths[name] = check_width(_int(node_w, None, err, name, lo=2))
            except ValueError as e:
                raise err(node_w, f"{name} {e}") from None
    per_node = fields.get("layer_bits", (None, None))[1]
    per: tuple = ()
    if per_node is not None:
        v = _scalar(per_node)
        if isinstance(v, dict):  # {5: 8/4, 11: exact}
            v = ",".join(f"{k}:{w}" for k, w in v.items())
        try:
            per = parse_layer_bits(str(v))
        except ValueError as e:
            raise err(per_node, f"layer_bits: {e}") from None
    calib_node = fields.get("calib", (None, None))[1]
    calib = False
    if calib_node is not None:
        v = _scalar(calib_node)
        if v not in (True, False, "on", "off"):  # YAML reads a bare on/off as a boolean
            raise err(calib_node, f"calib must be on or off, got {v!r}")
        calib = v in (True, "on")
    return Policy(keep_active_recent=keep, quantize_layers=layers, bits=bits, layer_bits=per, calib=calib, **widths)
