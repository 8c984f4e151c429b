"""Generation settings: frozen dataclasses whose `from_dict` ignores unknown keys. The CLI, the
Python API and batch lines share these defaults (plain Python: the CLI reads them without torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.errors import LarqlError


def _own(cls, raw: dict[str, Any], skip: set[str] = frozenset()) -> dict[str, Any]:
    """The entries of `raw` that are fields of `cls` (unknown keys and None ignored)."""
    own = {f.name for f in fields(cls)} - skip
    return {k: v for k, v in raw.items() if k in own and v is not None}


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise LarqlError(f"`{name}` must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise LarqlError(f"`temperature` must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LarqlError(f"`top_k` must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LarqlError(f"`top_p` must be in (0, 1], got {self.top_p}")


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_PROPOSALS = 32  # speculative decoding: proposals verified in one pass at most
DRAFT_TOKENS = 6  # ... and a draft model's proposals a step, unless told otherwise (the best measured: speculative.md)
DRAFT_P_MIN = 0.75  # a draft stops proposing at a token it gives less (llama.cpp's default too)
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# how an embedding pools its rows' final hidden states (decode/embed.py); the first is the default:
# in a causal model only the last row has read the whole text (docs/serve.md)
POOLINGS = ("last", "mean")


def check_pooling(name: str | None) -> str:
    """An embedding's pooling, checked (None: the default)."""
    if name is None:
        return POOLINGS[0]
    if name not in POOLINGS:
        raise LarqlError(f"`pooling` must be one of {', '.join(POOLINGS)}, got {name!r}")
    return name


@dataclass(frozen=True)
class Grammar:
    """What the output must match (decode/constraint.py): a JSON Schema (its JSON text), any JSON
    object, a regular expression, or a Lark or GBNF grammar (its text)."""

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise LarqlError(f"a grammar is one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 64
    prefill_chunk: int = 1024
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_at_eos: bool = True  # end at the model's EOS and end-of-turn ids
    stop: tuple[str, ...] = ()  # end where one of these strings appears in the text (which stops before it)
    grammar: Grammar | None = None  # the output must match it: every other token is masked before sampling
    logprobs: int | None = None  # None: none; N: each token's log-probability and the N likeliest beside it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) added to those logits (OpenAI: -100..100)
    frequency_penalty: float = 0.0  # OpenAI: minus (times generated so far) x this, per id
    presence_penalty: float = 0.0  # OpenAI: minus this, per id generated at least once
    repetition_penalty: float = 1.0  # llama.cpp's: a positive logit / p, a negative one x p (1: off), for the ids
    repeat_last_n: int = 64  # among the history's last N (-1: all of it)
    draft_tokens: int | None = None  # speculative decoding: ids the process's draft model proposes a step (None:
    # the draft's default, DRAFT_TOKENS unless its process was told otherwise; 0: no speculation)
    lookup: int = 0  # prompt lookup: up to N ids proposed from an earlier match of the history's tail (0: off)
    draft_p_min: float = DRAFT_P_MIN  # the first choice the draft gives less ends its proposals (0: always K)
    draft_fixed: bool = False  # propose up to draft_tokens / lookup every round (False: as many as measured to pay)
    thinking_budget: int | None = None  # a thinking model's reasoning: past N tokens the sequence closes the
    # block itself and the answer follows (decode/forcing.py); None: no limit

    def __post_init__(self):
        self._check_shaping()
        if self.max_tokens < 0:
            raise LarqlError(f"`max_tokens` must be >= 0, got {self.max_tokens}")
        if self.prefill_chunk < 1:
            raise LarqlError(f"`prefill_chunk` must be >= 1, got {self.prefill_chunk}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)) or not all(isinstance(s, str) for s in self.stop):
            raise LarqlError("`stop` must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise LarqlError("`stop` strings must not be empty")
        object.__setattr__(self, "stop", tuple(self.stop))

    def _check_shaping(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise LarqlError(f"`logprobs` must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise LarqlError(f"`{name}` must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise LarqlError(f"`repetition_penalty` must be a positive number, got {self.repetition_penalty}")
        for name, most in (("draft_tokens", MAX_PROPOSALS), ("lookup", MAX_PROPOSALS)):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= most:
                raise LarqlError(f"`{name}` must be in 0..{most}, got {getattr(self, name)}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise LarqlError(f"`draft_p_min` must be in [0, 1], got {self.draft_p_min}")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise LarqlError(f"`thinking_budget` must be >= 0, got {self.thinking_budget}")
        if self.repeat_last_n < -1:
            raise LarqlError(f"`repeat_last_n` must be >= -1 (-1: the whole history), got {self.repeat_last_n}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs = tuple((int(k), float(v)) for k, v in bias)
        for tok, b in pairs:
            if tok < 0 or not -100.0 <= b <= 100.0:
                raise LarqlError(f"`logit_bias` maps token ids >= 0 to biases in [-100, 100], got {tok}: {b}")
        object.__setattr__(self, "logit_bias", pairs)

    @property
    def shapes_logits(self) -> bool:
        """Anything but sampling itself changes the logits: a grammar, a bias or a penalty."""
        return self.grammar is not None or bool(self.logit_bias) or self.frequency_penalty != 0.0 or \
            self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "GenerationConfig":
        """Build from a flat dict (CLI flags, JSON lines); unknown keys are ignored."""
        sampling_keys = {f.name for f in fields(SamplingConfig)}
        sampling = SamplingConfig(**{k: v for k, v in raw.items() if k in sampling_keys and v is not None})
        return cls(sampling=sampling, **_own(cls, raw, skip={"sampling"}))


@dataclass(frozen=True)
class BatchConfig:
    """Continuous batching (scheduler.py): how many sequences share a step, and what they may hold."""

    parallel: int | None = None  # live sequences per process; None: default_parallel()
    kv_budget: int | None = None  # bytes of KV all live sequences may reserve together; None: no limit
    step_tokens: int = 1024  # rows per step beyond the decode rows (prefill chunks); one chunk always runs

    def __post_init__(self):
        if self.parallel is not None and self.parallel < 1:
            raise LarqlError(f"`parallel` must be >= 1, got {self.parallel}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise LarqlError(f"`kv_budget` must be positive, got {self.kv_budget}")
        if self.step_tokens < 1:
            raise LarqlError(f"`step_tokens` must be >= 1, got {self.step_tokens}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "BatchConfig":
        return cls(**_own(cls, raw))


PARALLEL_PER_CORE = 4  # where the scaling curve flattens (docs/batch.md)
PARALLEL_MAX = 16  # past here a step's attention and sampling, per sequence, outgrow the shared matrix work


def default_parallel(cores: int, workers: int = 1, device: str = "cpu") -> int:
    """Sequences per process when none is given: on the CPU four per core the process gets (cores /
    workers), at most 16; on CUDA 16 (one step's kernels have room for many more rows than that)."""
    if device == "cuda":
        return PARALLEL_MAX
    return max(1, min(PARALLEL_MAX, PARALLEL_PER_CORE * max(1, cores // max(1, workers))))


@dataclass(frozen=True)
class ServeConfig:
    """`larqlpy serve`: where it listens and what it allows (sizes in bytes)."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # when set, every /v1 and /metrics request needs `Authorization: Bearer KEY`
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    queue_size: int = 64  # requests waiting beyond the live ones; more are answered 429
    parallel: int | None = None  # live sequences; None: default_parallel()
    kv_budget: int = 512 << 20  # kept states in memory, all together
    disk_budget: int = 4 << 30  # kept states persisted to disk, all together
    state_dir: str | None = None  # keep states across restarts here; None: a temporary directory
    shutdown_grace_s: float = 10.0  # in-flight requests get this long to finish on shutdown
    name: str | None = None  # the model's name in the API; None: its directory's name
    engine: str | None = None  # the engine of requests that name none (as a run spells it)
    continuation: str | None = None
    options: tuple[str, ...] = ()
    pooling: str | None = None  # /v1/embeddings: the pooling of requests that name none
    max_embed_inputs: int = 64  # /v1/embeddings: inputs a request may carry (each is a sequence in the queue)
    # one of several replicas sharing `state_dir` (its name): kept states written through to its own
    # directory there, the others' read (state/prefix_cache.py)
    replica: str | None = None

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise LarqlError(f"`port` must be in 1..65535, got {self.port}")
        check_pooling(self.pooling)
        for name in ("max_body_bytes", "max_tokens_limit", "kv_budget", "disk_budget", "max_embed_inputs"):
            if getattr(self, name) < 1:
                raise LarqlError(f"`{name}` must be positive, got {getattr(self, name)}")
        if self.queue_size < 0:
            raise LarqlError(f"`queue_size` must be >= 0, got {self.queue_size}")
        if not 0 <= self.shutdown_grace_s < float("inf"):
            raise LarqlError(f"`shutdown_grace_s` must be a number of seconds >= 0, got {self.shutdown_grace_s}")
        if self.parallel is not None and self.parallel < 1:
            raise LarqlError(f"`parallel` must be >= 1, got {self.parallel}")
        if self.api_key is not None and not self.api_key:
            raise LarqlError("`api_key` must not be empty")
        object.__setattr__(self, "options", tuple(self.options))
        self.spec()

    def spec(self) -> EngineSpec:
        """The engine of requests that name none; a server keeps every request's state for later ones."""
        spec = parse_engine_spec(self.engine, self.continuation, list(self.options)) \
            if self.engine or self.continuation or self.options else EngineSpec()
        return spec.stateful("be served (a server keeps each request's state for later ones)")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ServeConfig":
        return cls(**_own(cls, raw))
