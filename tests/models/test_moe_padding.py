"""A mixture's prefill pads each expert's rows to a multiple of GEMM_ROWS before its GEMMs (each row count a
GEMM sees leaves state in torch for good): the GEMMs see a few counts, and the sum over each row's experts
is still what a float64 reference gives."""

import torch

from pagelm.models.moe import GEMM_ROWS, Experts
from pagelm.weights.linear import MAX_GEMV_ROWS, DenseLinear

HIDDEN, FFN, N_EXPERTS, TOP_K = 32, 24, 4, 2


class Counting(DenseLinear):
    def __init__(self, weight: torch.Tensor, seen: list[int]):
        super().__init__(weight)
        self.seen = seen

    def __call__(self, x: torch.Tensor, alone: bool = False) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return super().__call__(x, alone)


def _reference(y, router, gate_up, down) -> torch.Tensor:
    y, router = y.double(), router.double()
    weights, chosen = torch.topk(torch.softmax(y @ router.T, -1), TOP_K, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(y)
    for t in range(y.shape[0]):
        for j in range(TOP_K):
            e = int(chosen[t, j])
            gate, up = (gate_up[e].double() @ y[t]).chunk(2)
            out[t] += weights[t, j] * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def test_an_experts_rows_reach_its_gemms_padded_and_the_sum_is_unchanged():
    g = torch.Generator().manual_seed(0)
    router = torch.randn(N_EXPERTS, HIDDEN, generator=g)
    gate_up = [torch.randn(2 * FFN, HIDDEN, generator=g) / 4 for _ in range(N_EXPERTS)]
    down = [torch.randn(HIDDEN, FFN, generator=g) / 4 for _ in range(N_EXPERTS)]
    seen: list[int] = []
    experts = Experts(DenseLinear(router), [Counting(w, seen) for w in gate_up], [DenseLinear(w) for w in down],
                      top_k=TOP_K, normalize=True)
    y = torch.randn(101, HIDDEN, generator=g)
    got = experts(y, alone=False)
    gemm_counts = [n for n in seen if n > MAX_GEMV_ROWS]
    assert gemm_counts and all(n % GEMM_ROWS == 0 for n in gemm_counts), seen
    want = _reference(y, router, gate_up, down)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
