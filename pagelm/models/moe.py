"""A mixture of experts' feed-forward: a softmax router picks each token's top-k experts, each a
SiLU-gated MLP whose matrices stay where the loader put them (row ranges of the file's 3-D tensors).

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

    router: Linear  # (n_experts, hidden): ffn_gate_inp
    gate_up: list[Linear]  # per expert (2·ffn, hidden): its ffn_gate_exps rows, then its ffn_up_exps rows
    down: list[Linear]  # per expert (hidden, ffn)
    top_k: int
    normalize: bool  # the top-k weights renormalized to sum to 1
    # where a caller wants each call's choices: (rows, top_k) expert indices appended per call
    routes: list | None = None

    def route(self, y: torch.Tensor, alone: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (n, top_k) float32, experts (n, top_k) int64) of rows y: the top-k of the softmax
        of the router's logits, in float32, ties broken as torch.topk breaks them (as transformers)."""
        probs = torch.softmax(self.router(y, alone).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:  # a sequential sum (cumsum), each row's alone
            weights = weights / weights.cumsum(-1)[:, -1:]
        if self.routes is not None:
            self.routes.append(chosen.clone())
        return weights, chosen

    def __call__(self, y: torch.Tensor, alone: bool) -> torch.Tensor:
        """The float32 sum over each row's top-k experts e of weight · down_e(silu(gate_e) · up_e) of
        rows y (n, hidden): each expert once over the rows routed to it (the rows gathered by expert,
        a product per expert, put back in row order), then each row's experts added in its top-k order."""
        weights, chosen = self.route(y, alone)
        n, k = chosen.shape
        flat = chosen.reshape(-1)  # slot t·k + j: row t's j-th expert
        slots = torch.argsort(flat, stable=True)  # the slots grouped by expert
        experts, counts = torch.unique_consecutive(flat[slots], return_counts=True)
        rows = y.index_select(0, slots // k)
        done = torch.empty(n * k, y.shape[1], dtype=torch.float32, device=y.device)
        lo = 0
        for e, count in zip(experts.tolist(), counts.tolist()):
            done[lo : lo + count] = self._expert(e, rows[lo : lo + count], alone)
            lo += count
        outs = done[torch.argsort(slots)].view(n, k, -1).mul_(weights[:, :, None])
        total = outs[:, 0].clone()
        for j in range(1, k):
            total += outs[:, j]
        return total

    def _expert(self, e: int, y: torch.Tensor, alone: bool) -> torch.Tensor:
        gate, up = self.gate_up[e](y, alone).chunk(2, -1)
        if alone and y.shape[0] > 1:  # the activation of each row by itself (layers.gated_mlp's why)
            gated = torch.cat([F.silu(gate[r : r + 1]) for r in range(y.shape[0])]).mul_(up)
        else:
            gated = F.silu(gate).mul_(up)
        return self.down[e](gated, alone)
