"""Prefix-affinity request routing for the engine deployment: a request goes to the replica that
last served the longest of its prefixes (chained hashes at message boundaries, see wire.py).

Each router (one per deployment handle: in each ingress replica) keeps its own bounded view,
updated as it routes; nothing central is asked. A replica that is busy well beyond the least
loaded one, or full, loses the request to power of two choices by queue length.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MAX_ENTRIES = 65536  # prefix hashes remembered per router, least recently used dropped
IMBALANCE = 4  # ongoing requests more than the least loaded replica at which affinity yields


class AffinityTable:
    """Bounded LRU of prefix hash → replica that last served it."""

    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._owner: OrderedDict[str, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, hashes: Iterable[str], replica: Hashable) -> None:
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def longest(self, hashes: Sequence[str], live: set) -> Hashable | None:
        """The replica (among `live`) that served the longest of `hashes` (shortest first)."""
        for h in reversed(hashes):
            owner = self._owner.get(h)
            if owner is not None and owner in live:
                self._owner.move_to_end(h)
                return owner
        return None


def _hashes(request: PendingRequest | None) -> list[str]:
    return list(request.kwargs.get("prefix") or ()) if request is not None else []


class PrefixAffinityRouter(RequestRouter):
    """request_router_kwargs: policy "prefix" (default) or "random" (for comparison), max_entries,
    imbalance."""

    def initialize_state(self, policy: str = "prefix", max_entries: int = MAX_ENTRIES,
                         imbalance: int = IMBALANCE, **kwargs) -> None:
        if policy not in ("prefix", "random"):
            raise ValueError(f"routing policy must be prefix or random, got {policy!r}")
        self.policy, self.imbalance = policy, imbalance
        self.table = AffinityTable(max_entries)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # these ranks are all there is
        if not candidate_replicas:
            return []
        if self.policy == "random":
            return [[random.choice(candidate_replicas)]]
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        by_id = {r.replica_id: r for r in candidate_replicas}
        owner = self.table.longest(_hashes(pending_request), set(by_id))
        if owner is None or self._overloaded(owner, candidate_replicas):
            return [pair]
        return [[by_id[owner]], pair]

    def _overloaded(self, replica_id: ReplicaID, candidates: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        mine = cache.get(replica_id)
        lengths = [n for r in candidates if (n := cache.get(r.replica_id)) is not None]
        return mine is not None and bool(lengths) and mine - min(lengths) >= self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.table.record(_hashes(pending_request), replica_id)
