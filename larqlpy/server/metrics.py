"""/metrics in Prometheus' text format (prometheus_client): request counters kept here, and the
engine's figures -- live and waiting sequences, resident KV, the kept states by lifecycle state,
their transitions and the prefix cache's hits -- from the snapshot the engine thread publishes; and the
kernels compiled in this process (kernels/compiles.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from larqlpy.kernels import compiles


class Metrics:
    def __init__(self, engine):
        self.engine = engine
        disable_created_metrics()  # no *_created series beside each counter
        self.registry = CollectorRegistry()
        self.requests = Counter("larqlpy_requests", "requests answered, by HTTP status", ["status"],
                                registry=self.registry)
        self.tokens = Counter("larqlpy_tokens", "tokens of answered requests", ["kind"], registry=self.registry)
        self.speculative = Counter("larqlpy_speculative_tokens", "speculative decoding: tokens proposed, tokens "
                                   "the model accepted, and its verifying passes (steps)", ["kind"],
                                   registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def served(self, seqs) -> None:
        """A request answered in full: its choices' sequences (which share a key: the prompt counted
        once), or an embedding request's inputs (a key each)."""
        self.requests.labels("200").inc()
        self.tokens.labels("prompt").inc(sum(len(s.prompt_ids) for s in {s.key: s for s in seqs}.values()))
        self.tokens.labels("completion").inc(sum(len(s.output) for s in seqs))
        self.tokens.labels("cached").inc(seqs[0].held_from)
        for kind in ("proposed", "accepted", "steps"):
            self.speculative.labels(kind).inc(sum(getattr(s.verifier, kind) for s in seqs if s.verifier is not None))

    def failed(self, status: int) -> None:
        self.requests.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        snap = self.engine.snapshot
        by_kind, kept = snap.live_kv_by_kind, snap.kept
        yield GaugeMetricFamily("larqlpy_live_sequences", "sequences decoding or prefilling now", value=snap.live)
        yield GaugeMetricFamily("larqlpy_waiting_requests", "requests queued for a slot", value=snap.waiting)
        g = GaugeMetricFamily("larqlpy_live_kv_bytes", "resident KV of live sequences, by layer kind", labels=["kind"])
        for kind, n in sorted(by_kind.items()):
            g.add_metric([kind], n)
        yield g
        yield GaugeMetricFamily("larqlpy_live_kv_total_bytes", "resident KV of live sequences",
                                value=snap.live_kv_bytes)
        b = GaugeMetricFamily("larqlpy_kept_bytes", "kept states' bytes by lifecycle state (PERSISTED: on disk)",
                              labels=["state"])
        c = GaugeMetricFamily("larqlpy_kept_states", "kept states by lifecycle state", labels=["state"])
        for stage in kept["bytes"]:
            b.add_metric([stage], kept["bytes"][stage])
            c.add_metric([stage], kept["states"][stage])
        yield b
        yield c
        cells = GaugeMetricFamily("larqlpy_kept_cells", "cells of kept cells/v1 states in memory, by cell state",
                                  labels=["state"])
        for stage, n in sorted(kept["cells"].items()):
            cells.add_metric([stage], n)
        yield cells
        t = CounterMetricFamily("larqlpy_kept_transitions", "kept states' lifecycle transitions", labels=["from", "to"])
        for move, n in sorted(kept["transitions"].items()):
            src, dst = move.split("->")
            t.add_metric([src, dst], n)
        yield t
        p = CounterMetricFamily("larqlpy_prefix_cache", "requests by what the prefix cache gave them",
                                labels=["result"])
        for result in ("hits", "misses", "refusals"):
            p.add_metric([result], kept[result])
        yield p
        yield CounterMetricFamily("larqlpy_prefix_reused_tokens", "prompt tokens served from kept states",
                                  value=kept["reused_tokens"])
        yield CounterMetricFamily("larqlpy_compile_seconds", "seconds this process spent compiling kernels "
                                  "(a cold numba cache) and measuring kernel choices", value=compiles.seconds())
        yield CounterMetricFamily("larqlpy_compiled_kernels", "kernels this process compiled (and choices it "
                                  "measured)", value=compiles.count())
