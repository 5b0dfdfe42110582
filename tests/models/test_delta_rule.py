"""The compiled gated-delta-rule step, and the whole DeltaNet token, against float64 references
on odd shapes."""

import numpy as np
import pytest
import torch

from pagelm.models.delta_rule import delta_rule_step, deltanet_tokens


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


def _token_inputs(nk, nv, dk, dv, taps, n, seed):
    gen = torch.Generator().manual_seed(seed)
    channels, values = 2 * nk * dk + nv * dv, nv * dv
    proj = torch.randn(n, channels + values + 2 * nv, generator=gen)
    convs = [torch.randn(taps - 1, channels, generator=gen) for _ in range(n)]
    conv_w = torch.randn(taps, channels, generator=gen) * 0.5
    a, dt_bias = -torch.rand(nv, generator=gen) * 4, torch.randn(nv, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(dv, generator=gen)
    states = [torch.randn(nv, dk, dv, generator=gen) * 0.3 for _ in range(n)]
    return proj, convs, conv_w, a, dt_bias, norm_w, states


@pytest.mark.parametrize("nk,nv,dk,dv,taps,n", [(1, 1, 8, 4, 4, 1), (3, 6, 17, 23, 3, 3), (2, 6, 33, 5, 4, 2),
                                               (2, 2, 128, 128, 4, 1), (2, 4, 16, 24, 4, 5), (3, 7, 61, 53, 4, 2)])
def test_whole_token_matches_float64(nk, nv, dk, dv, taps, n):
    proj, convs, conv_w, a, dt_bias, norm_w, states = _token_inputs(nk, nv, dk, dv, taps, n, nv * 1000 + dv)
    wants = [token_reference(proj[i], convs[i], conv_w, a, dt_bias, norm_w, states[i].clone(), nk, 1e-6, 1e-6)
             for i in range(n)]
    o = deltanet_tokens(proj, convs, conv_w, a, dt_bias, norm_w, states, nk, 1e-6, 1e-6)
    assert o.dtype == torch.float32 and o.shape == (n, nv * dv)
    for row, conv, state, (want_o, want_conv, want_s) in zip(o, convs, states, wants):
        assert torch.equal(conv.double(), want_conv)  # the window moved on by exactly this token
        assert (row.double() - want_o).abs().max().item() <= 1e-5 * (1 + want_o.abs().max().item())
        assert (state.double() - want_s).abs().max().item() <= 1e-5 * (1 + want_s.abs().max().item())


@pytest.mark.parametrize("nk,nv,dk,dv,taps,n", [(3, 6, 17, 23, 3, 4), (2, 2, 128, 128, 4, 3)])
def test_batched_tokens_are_each_sequence_alone(nk, nv, dk, dv, taps, n):
    proj, convs, conv_w, a, dt_bias, norm_w, states = _token_inputs(nk, nv, dk, dv, taps, n, 7 + n)
    alone_convs, alone_states = [c.clone() for c in convs], [s.clone() for s in states]
    o = deltanet_tokens(proj, convs, conv_w, a, dt_bias, norm_w, states, nk, 1e-6, 1e-6)
    for i in range(n):
        want = deltanet_tokens(proj[i : i + 1], alone_convs[i : i + 1], conv_w, a, dt_bias, norm_w,
                               alone_states[i : i + 1], nk, 1e-6, 1e-6)
        assert torch.equal(o[i].view(torch.int32), want[0].view(torch.int32))
        assert torch.equal(convs[i], alone_convs[i]) and torch.equal(states[i], alone_states[i])


@pytest.mark.parametrize("nk,nv,dk,dv,taps", [(3, 6, 17, 23, 3), (2, 2, 128, 128, 4)])
def test_consecutive_tokens_in_one_call_are_each_decoded_alone_and_keep_every_state(nk, nv, dk, dv, taps):
    sequence_of = [0, 1, 0, 0, 1, 0]  # two sequences' tokens, interleaved: 4 of the first, 2 of the second
    proj, convs, conv_w, a, dt_bias, norm_w, states = _token_inputs(nk, nv, dk, dv, taps, len(sequence_of), 11)
    convs, states = convs[:2], states[:2]
    alone_convs, alone_states = [c.clone() for c in convs], [s.clone() for s in states]
    keeps = [(torch.empty_like(convs[0]), torch.empty_like(states[0])) for _ in sequence_of]
    keeps[-1] = None  # a pass's last row keeps nothing: its state is the live one
    o = deltanet_tokens(proj, convs, conv_w, a, dt_bias, norm_w, states, nk, 1e-6, 1e-6, sequence_of, keeps)
    for i, j in enumerate(sequence_of):
        want = deltanet_tokens(proj[i : i + 1], alone_convs[j : j + 1], conv_w, a, dt_bias, norm_w,
                               alone_states[j : j + 1], nk, 1e-6, 1e-6)
        assert torch.equal(o[i].view(torch.int32), want[0].view(torch.int32))
        if keeps[i] is not None:
            assert torch.equal(keeps[i][0], alone_convs[j]) and torch.equal(keeps[i][1], alone_states[j])
    assert all(torch.equal(c, ac) and torch.equal(s, as_) for c, ac, s, as_ in
               zip(convs, alone_convs, states, alone_states))


def test_tokens_refuse_states_they_do_not_take():
    proj, convs, conv_w, a, dt_bias, norm_w, states = _token_inputs(1, 2, 8, 4, 4, 2, 3)
    before = [s.clone() for s in states]
    for bad in (states[1].transpose(1, 2).contiguous().transpose(1, 2), states[1].double(), states[1][:1]):
        assert deltanet_tokens(proj, convs, conv_w, a, dt_bias, norm_w, [states[0], bad], 1, 1e-6, 1e-6) is None
    assert deltanet_tokens(proj, convs[:1], conv_w, a, dt_bias, norm_w, states, 1, 1e-6, 1e-6) is None
    assert all(torch.equal(s, b) for s, b in zip(states, before))


_DIGEST = """
import hashlib, torch
from pagelm.models.delta_rule import delta_rule_step
g = torch.Generator().manual_seed(0)
q, k = torch.randn(4, 128, generator=g), torch.randn(4, 128, generator=g)
v, decay, beta = torch.randn(8, 128, generator=g), -torch.rand(8, generator=g), torch.rand(8, generator=g)
state = torch.randn(8, 128, 128, generator=g) * 0.1
out = delta_rule_step(q, k, v, decay, beta, state)
print(hashlib.sha256(out.numpy().tobytes() + state.numpy().tobytes()).hexdigest())
"""


def test_the_step_has_the_same_bits_compiled_or_loaded_from_numbas_cache(tmp_path):
    """The step compiled in the process and the same step loaded from numba's cache once gave
    different bits (with its multiply-adds left to fastmath's contraction): a Qwen3.5 process that
    compiled the kernels decoded other logits than the next one, which loaded them."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    digests = [subprocess.run([sys.executable, "-c", _DIGEST], env=env, check=True, capture_output=True,
                              text=True).stdout for _ in range(2)]  # the first compiles and saves, the second loads
    assert any(tmp_path.rglob("*.nbc")) and digests[0] == digests[1]
