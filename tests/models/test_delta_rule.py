"""The compiled gated-delta-rule step, and the whole DeltaNet token, against float64 references
on odd shapes."""

import numpy as np
import pytest
import torch

from pagelm.models.delta_rule import delta_rule_step, deltanet_token


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


def token_reference(proj, conv_state, conv_w, a, dt_bias, norm_w, state, nk, eps, l2_eps):
    """One DeltaNet token in float64 from the definitions (Qwen3.5's linear attention, transformers'
    order of operations): conv + SiLU, L2-normalised q (scaled) and k, β = σ(b), g = a·softplus(α + dt),
    the delta rule, RMS norm of each head's output times SiLU(z)."""
    proj, conv_state, conv_w, a, dt_bias, norm_w, state = (t.double() for t in (proj, conv_state, conv_w, a, dt_bias,
                                                                                 norm_w, state))
    nv, dk, dv = state.shape
    channels, values = conv_state.shape[1], nv * dv
    window = torch.cat((conv_state, proj[None, :channels]))
    x = torch.nn.functional.silu((window * conv_w).sum(0))
    qk = x[: 2 * nk * dk].view(2 * nk, dk)
    qk = qk * torch.rsqrt(qk.pow(2).sum(-1, keepdim=True) + l2_eps)
    q, k = qk[:nk] * dk**-0.5, qk[nk:]
    v = x[2 * nk * dk :].view(nv, dv)
    z = proj[channels : channels + values].view(nv, dv)
    beta = torch.sigmoid(proj[channels + values : channels + values + nv])
    g = a * torch.nn.functional.softplus(proj[channels + values + nv :] + dt_bias)
    o, state = reference(q, k, v, g, beta, state)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_w * torch.nn.functional.silu(z)
    return o.reshape(-1), window[1:], state


@pytest.mark.parametrize("nk,nv,dk,dv,taps", [(1, 1, 8, 4, 4), (3, 6, 17, 23, 3), (2, 6, 33, 5, 4), (2, 2, 128, 128, 4)])
def test_whole_token_matches_float64(nk, nv, dk, dv, taps):
    gen = torch.Generator().manual_seed(nv * 1000 + dv)
    channels, values = 2 * nk * dk + nv * dv, nv * dv
    proj = torch.randn(channels + values + 2 * nv, generator=gen)
    conv_state = torch.randn(taps - 1, channels, generator=gen)
    conv_w = torch.randn(taps, channels, generator=gen) * 0.5
    a, dt_bias = -torch.rand(nv, generator=gen) * 4, torch.randn(nv, generator=gen)
    norm_w, state = 1 + 0.1 * torch.randn(dv, generator=gen), torch.randn(nv, dk, dv, generator=gen) * 0.3
    want_o, want_conv, want_s = token_reference(proj, conv_state, conv_w, a, dt_bias, norm_w, state.clone(), nk,
                                                1e-6, 1e-6)
    o = deltanet_token(proj, conv_state, conv_w, a, dt_bias, norm_w, state, nk, 1e-6, 1e-6)
    assert o.dtype == torch.float32 and o.shape == (values,)
    assert torch.equal(conv_state.double(), want_conv)  # the window moved on by exactly this token
    scale = 1 + want_s.abs().max().item()
    assert (o.double() - want_o).abs().max().item() <= 1e-5 * (1 + want_o.abs().max().item())
    assert (state.double() - want_s).abs().max().item() <= 1e-5 * scale
