"""One token of the gated delta rule as a compiled kernel over the recurrent state in place.

Owns only that step (the decode path of Qwen3.5's DeltaNet layers on the CPU): torch spends a
millisecond per layer on its five small ops over the state; one pass to read it and one to update
it take a few microseconds per head.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange


@njit(parallel=True, cache=True, fastmath={"contract"})
def _step(q, k, v, decay, beta, state, out):
    nv, dk, dv = state.shape
    nk = q.shape[0]
    for h in prange(nv):
        kh, e, b = h % nk, decay[h], beta[h]
        read_k = np.zeros(dv, np.float32)
        read_q = np.zeros(dv, np.float32)
        kq = np.float32(0)
        for i in range(dk):
            ki, qi = k[kh, i], q[kh, i]
            kq += ki * qi
            for j in range(dv):
                s = state[h, i, j]
                read_k[j] += s * ki
                read_q[j] += s * qi
        delta = read_k  # reused: δ = β(v − e·S₀ᵀk)
        for j in range(dv):
            delta[j] = (v[h, j] - e * read_k[j]) * b
            out[h, j] = e * read_q[j] + kq * delta[j]
        for i in range(dk):
            ki = k[kh, i]
            for j in range(dv):
                state[h, i, j] = e * state[h, i, j] + ki * delta[j]


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor:
    """One token: q, k (nk, dk); v (nv, dv); g (log decay), beta (nv,); state (nv, dk, dv), all
    float32 on the CPU, state contiguous and advanced in place. Value head j reads key head
    j mod nk. S = e^g·S₀ + k δᵀ with δ = β(v − e^g·S₀ᵀk); returns o = Sᵀq = e^g·S₀ᵀq + (k·q)δ, (nv, dv)."""
    out = torch.empty(v.shape, dtype=torch.float32)
    _step(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), g.exp().contiguous().numpy(),
          beta.contiguous().numpy(), state.numpy(), out.numpy())
    return out
