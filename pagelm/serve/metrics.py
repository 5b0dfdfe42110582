"""Latency and batch-size histograms the engine worker records, and the Prometheus text of
/metrics (counters of a Server's stats, histograms as cumulative buckets, sum, count); read from
request handlers while the engine writes.
"""

from __future__ import annotations

import threading
from typing import Sequence

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SEQUENCES = (1, 2, 4, 8, 16, 32, 64)


class Histogram:
    """Counts of observations at or under each bound (the last bucket, +Inf, counts them all)."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> dict:
        """{"buckets": [[bound or "+Inf", cumulative count], …], "sum", "count"}."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip([*self.bounds, "+Inf"], counts):
            running += n
            cumulative.append([bound, running])
        return {"buckets": cumulative, "sum": total, "count": running}


class EngineHistograms:
    """What one worker records: sequences per batched decode step, seconds a request waited for a
    slot, to its first token, and between its tokens; and where the engine's time goes: seconds of
    each batched decode step, of each prefill segment, and of each step's part of a segment (a
    segment is run a few layers per step while other slots decode)."""

    def __init__(self):
        self.batch_size = Histogram(SEQUENCES)
        self.queue_wait_seconds = Histogram(SECONDS)
        self.time_to_first_token_seconds = Histogram(SECONDS)
        self.inter_token_latency_seconds = Histogram(SECONDS)
        self.decode_step_seconds = Histogram(SECONDS)
        self.prefill_segment_seconds = Histogram(SECONDS)
        self.prefill_slice_seconds = Histogram(SECONDS)

    def snapshot(self) -> dict:
        return {name: h.snapshot() for name, h in vars(self).items()}


def merge(snapshots: Sequence[dict]) -> dict:
    """The sum of several workers' snapshots (of the same bounds), e.g. a cluster's replicas."""
    merged: dict = {}
    for snapshot in snapshots:
        for name, h in snapshot.items():
            into = merged.setdefault(name, {"buckets": [[b, 0] for b, _ in h["buckets"]], "sum": 0.0, "count": 0})
            for bucket, (_, n) in zip(into["buckets"], h["buckets"]):
                bucket[1] += n
            into["sum"] += h["sum"]
            into["count"] += h["count"]
    return merged


def prometheus(prefix: str, snapshot: dict, label: str = "") -> list[str]:
    """Prometheus text lines of a snapshot; `label` like 'replica="r1"' is added to each series."""
    lines = []
    extra = f",{label}" if label else ""
    plain = f"{{{label}}}" if label else ""
    for name, h in snapshot.items():
        for bound, n in h["buckets"]:
            lines.append(f'{prefix}_{name}_bucket{{le="{bound}"{extra}}} {n}')
        lines.append(f"{prefix}_{name}_sum{plain} {h['sum']}")
        lines.append(f"{prefix}_{name}_count{plain} {h['count']}")
    return lines


def prometheus_text(stats: dict) -> str:
    """Prometheus text of a Server's stats: its totals, and with `replicas` (engines elsewhere)
    each one's figures as pagelm_replica_* labelled by replica."""
    lines = []
    for prefix, label, figures in [("pagelm", "", stats)] + [
            ("pagelm_replica", f'{{replica="{r["replica"]}"}}', r) for r in stats.get("replicas", ())]:
        for group in ("prefix_cache", "image_cache", "requests", "memory", "slots", "speculation", "experts"):
            for key, value in figures.get(group, {}).items():
                if isinstance(value, (bool, int, float)):
                    lines.append(f"{prefix}_{group}_{key}{label} {int(value) if isinstance(value, bool) else value}")
        lines += prometheus(prefix, figures.get("histograms", {}), label.strip("{}"))
    return "\n".join(lines) + "\n"
