"""A mixture of experts' feed-forward: a router picks each token's top-k experts, each a gated MLP
whose matrices stay where the loader put them (row ranges of the file's 3-D tensors); optionally a
shared expert every token takes, behind a sigmoid gate (Qwen3.5-MoE's).

Owns routing and the combination of the routed experts' outputs; never loads weights. Two routers:
qwen3moe's softmax over every expert, then the top k (optionally renormalized); gpt-oss's top k of
the logits, then a softmax over those k. Two activations: SiLU-gated (`silu_glu`) and gpt-oss's
clamped SwiGLU (`ClampedSwiglu`). Only routed experts are multiplied, each once per call over the
rows routed to it: in a decode step of several sequences (`alone`) those rows take the few-row
kernels, each row's bits its own, and every row sums its experts in its own top-k order, so that a
sequence's bits never depend on the others in the step. Decode rows over mapped weights run in numpy
between the kernels (`rows`); a prefill's in torch. In a prefill, once routed, the experts' pages are
hinted to the OS (`pages`) before their products read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from pagelm.quant.int8dot import Int8Rows
from pagelm.weights.linear import MAX_GEMV_ROWS, Linear
from pagelm.weights.mapped import ExpertPages


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (qwen3moe's and qwen35moe's experts), into gate's activation."""
    return F.silu(gate).mul_(up)


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation, transformers' GptOssExperts._apply_gate: gate clamped above at
    `limit`, up clamped to ±limit, (up + 1) · gate · sigmoid(alpha · gate)."""

    limit: float = 7.0
    alpha: float = 1.702

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up.clamp(-self.limit, self.limit) + 1) * glu


GEMM_ROWS = 16  # an expert's rows in a prefill are padded to a multiple of this (_padded)


@dataclass
class ExpertTraffic:
    """What a model's mixtures read in decode steps (calls whose rows are each a sequence's next
    token: `alone`, or one row), summed: the weight bytes of the experts each call multiplied (each
    once, however many rows it took; the shared expert's too) and the rows (tokens) the calls took,
    over `layers` mixtures."""

    layers: int
    expert_bytes: int  # every expert's, routed and shared, of every layer: what the model holds in experts
    bytes: int = 0
    rows: int = 0

    @property
    def per_token(self) -> float:
        """Expert bytes read per token, all layers: a decode step of one sequence reads this much."""
        return self.bytes * self.layers / self.rows if self.rows else 0.0

    def reset(self) -> None:
        self.bytes = self.rows = 0


@dataclass
class Experts:
    """One layer's mixture: its router and each expert's two operators, as the loader made them."""

    # (n_experts, hidden): ffn_gate_inp; with a shared expert one more row, its gate's (ffn_gate_inp_shexp),
    # so that one product gives both
    router: Linear
    gate_up: list[Linear]  # per expert (2·ffn, hidden): its ffn_gate_exps rows, then its ffn_up_exps rows
    down: list[Linear]  # per expert (hidden, ffn)
    top_k: int
    normalize: bool  # the top-k weights renormalized to sum to 1 (softmax_first only)
    # the shared expert's (gate_up, down), as an expert's (ffn_{gate,up,down}_shexp), or None
    shared: tuple[Linear, Linear] | None = None
    softmax_first: bool = True  # softmax over every expert, then top-k; else top-k logits, then their softmax
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_glu  # (gate, up) -> the gated rows
    router_bias: torch.Tensor | None = None  # (n_experts,) float32
    gate_up_bias: torch.Tensor | None = None  # (n_experts, 2·ffn) float32, gate's then up's
    down_bias: torch.Tensor | None = None  # (n_experts, hidden) float32
    # where a caller wants each call's choices: (rows, top_k) expert indices appended per call
    routes: list | None = None
    traffic: ExpertTraffic | None = None  # where a caller counts the expert bytes read (`track`)
    pages: ExpertPages | None = None  # each expert's pages in the file map, hinted once routed

    @cached_property
    def expert_nbytes(self) -> list[int]:
        """Each routed expert's weight bytes (its gate, up and down rows)."""
        return [g.weight_nbytes + d.weight_nbytes for g, d in zip(self.gate_up, self.down)]

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (n, top_k) float32, experts (n, top_k) int64) of the router's logits (n, n_experts),
        in float32, ties broken as torch.topk breaks them (as transformers)."""
        logits = logits.float()
        if self.router_bias is not None:
            logits = logits + self.router_bias
        if self.softmax_first:
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
            if self.normalize:  # a sequential sum (cumsum), each row's alone
                weights = weights / weights.cumsum(-1)[:, -1:]
        else:
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        if self.routes is not None:
            self.routes.append(chosen.clone())
        return weights, chosen

    def __call__(self, y: torch.Tensor, alone: bool) -> torch.Tensor:
        """The float32 sum over each row's top-k experts e of weight · down_e(act(gate_e, up_e)) of
        rows y (n, hidden): each expert once over the rows routed to it (the rows gathered by expert,
        a product per expert, put back in row order), then each row's experts added in its top-k order;
        then the shared expert's output times the sigmoid of its gate, where there is one."""
        if (alone or y.shape[0] == 1) and self.takes_rows:
            return torch.from_numpy(self.rows(y.to(torch.float32).contiguous().numpy()))
        logits = self.router(y, alone)
        n_routed = len(self.gate_up)
        weights, chosen = self.route(logits[:, :n_routed])
        n, k = chosen.shape
        flat = chosen.reshape(-1)  # slot t·k + j: row t's j-th expert
        slots = torch.argsort(flat, stable=True)  # the slots grouped by expert
        experts, counts = torch.unique_consecutive(flat[slots], return_counts=True)
        rows = y.index_select(0, slots // k)
        done = torch.empty(n * k, y.shape[1], dtype=torch.float32, device=y.device)
        lo, routed = 0, experts.tolist()
        if self.pages is not None and n > 1 and not alone:  # a prefill's: a decode step's hints cost more than
            self.pages.prefetch(routed)  # they save on a warm cache (24 madvise calls a layer, ~0.6 ms)
        for e, count in zip(routed, counts.tolist()):
            done[lo : lo + count] = self._expert(e, _padded(rows[lo : lo + count]), alone)[:count]
            lo += count
        if alone or n == 1:
            self._count(routed, n)
        outs = done[torch.argsort(slots)].view(n, k, -1).mul_(weights[:, :, None])
        total = outs[:, 0].clone()
        for j in range(1, k):
            total += outs[:, j]
        if self.shared is not None:
            gate = _each_row(torch.sigmoid, logits[:, n_routed:].float(), alone=alone)
            total += _gated(*self.shared, y, alone).float().mul_(gate)
        return total

    @cached_property
    def takes_rows(self) -> bool:
        """Whether decode rows take `rows`: every operator's few-row products are float32 (mapped weights)."""
        ops = [self.router, *self.gate_up, *self.down, *(self.shared or ())]
        return all(op.few_rows_dtype is torch.float32 for op in ops)

    def rows(self, y: np.ndarray) -> np.ndarray:
        """__call__ of decode rows y (float32 (n, hidden), C-contiguous), each row alone, in numpy between
        the kernels, without torch's dispatch around each of a layer's ~25 products: the same grouping by
        expert and the same operations in the same order. With int8 products, y is quantized once for
        the router and every expert of a row."""
        n_routed, n = len(self.gate_up), y.shape[0]
        # y's int8 form, made once for the products of all of y: the router's, the shared expert's, and with
        # one row its experts' (several rows go to each expert in groups of their own)
        users = [self.router, *self.gate_up[:1 if n == 1 else 0], *(self.shared or ())[:1]]
        int8 = Int8Rows(y) if any(op.takes_int8 for op in users) else None
        logits = torch.from_numpy(self.router.rows(y, True, int8=int8))
        weights, chosen = self.route(logits[:, :n_routed])
        k = chosen.shape[1]
        groups: dict[int, list[int]] = {}  # each routed expert's slots t·k + j (row t's j-th expert), in order
        for slot, e in enumerate(chosen.reshape(-1).tolist()):
            groups.setdefault(e, []).append(slot)
        outs = np.empty((n, k, y.shape[1]), np.float32)
        for e, slots in groups.items():
            rows = [slot // k for slot in slots]
            x = y[rows[0] : rows[0] + 1] if len(rows) == 1 else y[rows]
            out = self._expert_rows(e, x, int8 if n == 1 else None)
            for i, (t, slot) in enumerate(zip(rows, slots)):
                outs[t, slot - k * t] = out[i]
        self._count(list(groups), n)
        outs *= weights.numpy()[:, :, None]
        total = outs[:, 0].copy()
        for j in range(1, k):
            total += outs[:, j]
        if self.shared is not None:
            gate = _each_row(torch.sigmoid, logits[:, n_routed:], alone=True).numpy()
            total += _gated_rows(*self.shared, y, int8=int8) * gate
        return total

    def _expert_rows(self, e: int, y: np.ndarray, int8: Int8Rows | None = None) -> np.ndarray:
        bias = None if self.gate_up_bias is None else self.gate_up_bias[e].numpy()
        out = _gated_rows(self.gate_up[e], self.down[e], y, self.activation, bias, int8)
        return out if self.down_bias is None else out + self.down_bias[e].numpy()

    def _count(self, routed: list[int], n: int) -> None:
        """A decode call's expert bytes and rows into `traffic`, where counted."""
        if self.traffic is None:
            return
        read = sum(self.expert_nbytes[e] for e in routed)
        if self.shared is not None:
            read += self.shared[0].weight_nbytes + self.shared[1].weight_nbytes
        self.traffic.bytes, self.traffic.rows = self.traffic.bytes + read, self.traffic.rows + n

    def _expert(self, e: int, y: torch.Tensor, alone: bool) -> torch.Tensor:
        bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
        out = _gated(self.gate_up[e], self.down[e], y, alone, self.activation, bias)
        return out if self.down_bias is None else out.float() + self.down_bias[e]


def _padded(rows: torch.Tensor) -> torch.Tensor:
    """rows with zero rows after them up to a multiple of GEMM_ROWS where they go to a GEMM (more than
    MAX_GEMV_ROWS): each row count a GEMM sees leaves ~0.3 MiB in torch's CPU GEMM state for good (0.7 with
    oneDNN's primitive cache of 64), and a mixture's prefill gives its experts every count from a few to
    hundreds; rounded, a handful."""
    n = rows.shape[0]
    if n <= MAX_GEMV_ROWS or n % GEMM_ROWS == 0:
        return rows
    return torch.cat([rows, rows.new_zeros(GEMM_ROWS - n % GEMM_ROWS, rows.shape[1])])


def _each_row(fn, *xs: torch.Tensor, alone: bool) -> torch.Tensor:
    """fn(*xs) of rows; with `alone`, of each row by itself (layers.gated_mlp's why: a transcendental's
    bits depend on how many values a call has)."""
    if alone and xs[0].shape[0] > 1:
        return torch.cat([fn(*(x[r : r + 1] for x in xs)) for r in range(xs[0].shape[0])])
    return fn(*xs)


def _gated(gate_up: Linear, down: Linear, y: torch.Tensor, alone: bool, activation=silu_glu,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """down(activation(gate, up)) of rows y, gate and up the halves of gate_up(y) (+ bias)."""
    both = gate_up(y, alone)
    if bias is not None:
        both = both.float() + bias
    gate, up = both.chunk(2, -1)
    return down(_each_row(activation, gate, up, alone=alone), alone)


def _gated_rows(gate_up: Linear, down: Linear, y: np.ndarray, activation=silu_glu,
                bias: np.ndarray | None = None, int8: Int8Rows | None = None) -> np.ndarray:
    """_gated of decode rows y in numpy (float32, C-contiguous), each row alone; int8: Int8Rows(y) or None."""
    both = gate_up.rows(y, True, int8=int8)
    if bias is not None:
        both += bias
    gate, up = torch.from_numpy(both).chunk(2, -1)
    return down.rows(_each_row(activation, gate, up, alone=True).numpy(), True)


def mixtures(network) -> list[Experts]:
    """A network's mixtures of experts, each found among its layer's weights."""
    return [v for layer in getattr(network, "layers", ()) for v in vars(layer).values() if isinstance(v, Experts)]


def track(network) -> ExpertTraffic | None:
    """One ExpertTraffic counting every mixture of `network` from now on; None where it has none."""
    found = mixtures(network)
    if not found:
        return None
    held = sum(sum(e.expert_nbytes) + (e.shared[0].weight_nbytes + e.shared[1].weight_nbytes if e.shared else 0)
               for e in found)
    traffic = ExpertTraffic(len(found), held)
    for experts in found:
        experts.traffic = traffic
    return traffic
