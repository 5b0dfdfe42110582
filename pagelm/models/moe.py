"""A mixture of experts' feed-forward: a softmax router picks each token's top-k experts, each a
SiLU-gated MLP whose matrices stay where the loader put them (row ranges of the file's 3-D tensors);
optionally a shared expert every token takes, behind a sigmoid gate (Qwen3.5-MoE's).

Owns routing and the combination of the routed experts' outputs; never loads weights. Only routed
experts are multiplied, each once per call over the rows routed to it: in a decode step of several
sequences (`alone`) those rows take the few-row kernels, each row's bits its own, and every row sums
its experts in its own top-k order, so that a sequence's bits never depend on the others in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagelm.weights.linear import Linear


@dataclass
class Experts:
    """One layer's mixture: its router and each expert's two operators, as the loader made them."""

    # (n_experts, hidden): ffn_gate_inp; with a shared expert one more row, its gate's (ffn_gate_inp_shexp),
    # so that one product gives both
    router: Linear
    gate_up: list[Linear]  # per expert (2·ffn, hidden): its ffn_gate_exps rows, then its ffn_up_exps rows
    down: list[Linear]  # per expert (hidden, ffn)
    top_k: int
    normalize: bool  # the top-k weights renormalized to sum to 1
    # the shared expert's (gate_up, down), as an expert's (ffn_{gate,up,down}_shexp), or None
    shared: tuple[Linear, Linear] | None = None
    # where a caller wants each call's choices: (rows, top_k) expert indices appended per call
    routes: list | None = None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (n, top_k) float32, experts (n, top_k) int64) of the router's logits (n, n_experts):
        the top-k of their softmax in float32, ties broken as torch.topk breaks them (as transformers)."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:  # a sequential sum (cumsum), each row's alone
            weights = weights / weights.cumsum(-1)[:, -1:]
        if self.routes is not None:
            self.routes.append(chosen.clone())
        return weights, chosen

    def __call__(self, y: torch.Tensor, alone: bool) -> torch.Tensor:
        """The float32 sum over each row's top-k experts e of weight · down_e(silu(gate_e) · up_e) of
        rows y (n, hidden): each expert once over the rows routed to it (the rows gathered by expert,
        a product per expert, put back in row order), then each row's experts added in its top-k order;
        then the shared expert's output times the sigmoid of its gate, where there is one."""
        logits = self.router(y, alone)
        n_routed = len(self.gate_up)
        weights, chosen = self.route(logits[:, :n_routed])
        n, k = chosen.shape
        flat = chosen.reshape(-1)  # slot t·k + j: row t's j-th expert
        slots = torch.argsort(flat, stable=True)  # the slots grouped by expert
        experts, counts = torch.unique_consecutive(flat[slots], return_counts=True)
        rows = y.index_select(0, slots // k)
        done = torch.empty(n * k, y.shape[1], dtype=torch.float32, device=y.device)
        lo = 0
        for e, count in zip(experts.tolist(), counts.tolist()):
            done[lo : lo + count] = _gated(self.gate_up[e], self.down[e], rows[lo : lo + count], alone)
            lo += count
        outs = done[torch.argsort(slots)].view(n, k, -1).mul_(weights[:, :, None])
        total = outs[:, 0].clone()
        for j in range(1, k):
            total += outs[:, j]
        if self.shared is not None:
            gate = _each_row(torch.sigmoid, logits[:, n_routed:].float(), alone)
            total += _gated(*self.shared, y, alone).float().mul_(gate)
        return total


def _each_row(fn, x: torch.Tensor, alone: bool) -> torch.Tensor:
    """fn(x); with `alone`, of each row by itself (layers.gated_mlp's why: a transcendental's bits
    depend on how many values a call has)."""
    if alone and x.shape[0] > 1:
        return torch.cat([fn(x[r : r + 1]) for r in range(x.shape[0])])
    return fn(x)


def _gated(gate_up: Linear, down: Linear, y: torch.Tensor, alone: bool) -> torch.Tensor:
    """down(silu(gate) · up) of rows y, gate and up the halves of gate_up(y)."""
    gate, up = gate_up(y, alone).chunk(2, -1)
    return down(_each_row(F.silu, gate, alone).mul_(up), alone)
