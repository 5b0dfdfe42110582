"""The compiled gated-delta-rule step against a float64 reference, on odd shapes."""

import numpy as np
import pytest
import torch

from pagelm.models.delta_rule import delta_rule_step


def reference(q, k, v, g, beta, state):
    """One token in float64, straight from the definition: S = e^g·S; δ = β(v − Sᵀk); S += k δᵀ; o = Sᵀq."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    nv, nk = v.shape[0], q.shape[0]
    out = torch.empty(v.shape, dtype=torch.float64)
    for h in range(nv):
        S = torch.exp(g[h]) * s[h]
        delta = beta[h] * (v[h] - S.T @ k[h % nk])
        S = S + torch.outer(k[h % nk], delta)
        s[h], out[h] = S, S.T @ q[h % nk]
    return out, s


@pytest.mark.parametrize("nk,nv,dk,dv", [(1, 1, 8, 4), (3, 6, 17, 23), (2, 2, 128, 128), (2, 6, 33, 5)])
def test_step_matches_float64(nk, nv, dk, dv):
    gen = torch.Generator().manual_seed(nk * 100 + dk)
    q = torch.nn.functional.normalize(torch.randn(nk, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(nk, dk, generator=gen), dim=-1)
    v, g, beta = torch.randn(nv, dv, generator=gen), -torch.rand(nv, generator=gen), torch.rand(nv, generator=gen)
    state = torch.randn(nv, dk, dv, generator=gen) * 0.3
    want_o, want_s = reference(q, k, v, g, beta, state.clone())
    o = delta_rule_step(q, k, v, g, beta, state)
    scale = 1 + want_s.abs().max().item()
    assert o.dtype == torch.float32 and o.shape == (nv, dv)
    assert np.abs(o.double() - want_o).max().item() <= 1e-5 * scale
    assert np.abs(state.double() - want_s).max().item() <= 1e-5 * scale
