"""One token of Qwen3.5's DeltaNet mixer as compiled kernels over its states in place.

Owns the decode path on the CPU between the input projection and the output projection: the
gated delta rule step alone (`delta_rule_step`), and the whole token (`deltanet_token`: causal
conv and SiLU, L2 norms, gates, the step, the gated RMS norm). torch spends a millisecond per layer
on the step's five small ops over the state, and ~25 dispatches on the rest; one pass to read the
state and one to update it take a few microseconds per head.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange


@njit(cache=True, fastmath={"contract"})
def _advance_head(state, k, q, v, e, b, out):
    """One value head: state (dk, dv) ← e·state + k δᵀ with δ = b(v − e·stateᵀk); out ← e·stateᵀq + (k·q)δ
    from one read of the old state."""
    dk, dv = state.shape
    read_k = np.zeros(dv, np.float32)
    read_q = np.zeros(dv, np.float32)
    kq = np.float32(0)
    for i in range(dk):
        ki, qi = k[i], q[i]
        kq += ki * qi
        for j in range(dv):
            s = state[i, j]
            read_k[j] += s * ki
            read_q[j] += s * qi
    delta = read_k  # reused
    for j in range(dv):
        delta[j] = (v[j] - e * read_k[j]) * b
        out[j] = e * read_q[j] + kq * delta[j]
    for i in range(dk):
        ki = k[i]
        for j in range(dv):
            state[i, j] = e * state[i, j] + ki * delta[j]


@njit(parallel=True, cache=True)
def _step(q, k, v, decay, beta, state, out):
    nk = q.shape[0]
    for h in prange(state.shape[0]):
        _advance_head(state[h], k[h % nk], q[h % nk], v[h], decay[h], beta[h], out[h])


@njit(cache=True)
def _sigmoid(x):
    return np.float32(1) / (np.float32(1) + np.exp(-x))


@njit(cache=True)
def _softplus(x):  # torch's: x itself above 20
    return x if x > np.float32(20) else np.log1p(np.exp(x))


@njit(parallel=True, cache=True, fastmath={"contract"})
def _token(proj, conv_state, conv_w, a, dt_bias, norm_w, state, nk, eps, l2_eps, out):
    taps, channels = conv_state.shape
    nv, dk, dv = state.shape
    values = nv * dv
    x = np.empty(channels, np.float32)
    for c in prange(channels):  # depthwise causal conv over the last taps inputs and this one, SiLU
        acc = proj[c] * conv_w[taps, c]
        for j in range(taps):
            acc += conv_state[j, c] * conv_w[j, c]
        for j in range(taps - 1):
            conv_state[j, c] = conv_state[j + 1, c]
        conv_state[taps - 1, c] = proj[c]
        x[c] = acc * _sigmoid(acc)
    q_scale = np.float32(dk ** -0.5)
    for head in prange(2 * nk):  # q heads then k heads, L2-normalised; q scaled too
        base = head * dk
        ss = np.float32(0)
        for i in range(dk):
            ss += x[base + i] * x[base + i]
        r = np.float32(1) / np.sqrt(ss + l2_eps)
        if head < nk:
            r *= q_scale
        for i in range(dk):
            x[base + i] *= r
    k0, v0 = nk * dk, 2 * nk * dk
    for h in prange(nv):
        kh = h % nk
        b = _sigmoid(proj[channels + values + h])
        e = np.exp(a[h] * _softplus(proj[channels + values + nv + h] + dt_bias[h]))
        o = out[h * dv:(h + 1) * dv]
        _advance_head(state[h], x[k0 + kh * dk:k0 + (kh + 1) * dk], x[kh * dk:(kh + 1) * dk],
                      x[v0 + h * dv:v0 + (h + 1) * dv], e, b, o)
        ss = np.float32(0)
        for j in range(dv):
            ss += o[j] * o[j]
        r = np.float32(1) / np.sqrt(ss / np.float32(dv) + eps)
        for j in range(dv):
            z = proj[channels + h * dv + j]
            o[j] = o[j] * r * norm_w[j] * (z * _sigmoid(z))


def deltanet_token(proj: torch.Tensor, conv_state: torch.Tensor, conv_w: torch.Tensor, a: torch.Tensor,
                   dt_bias: torch.Tensor, norm_w: torch.Tensor, state: torch.Tensor, nk: int, eps: float,
                   l2_eps: float) -> torch.Tensor:
    """One token of the mixer from its input projection `proj` (channels + nv·dv + 2·nv,) float32:
    [q k v for the conv | z | beta | alpha]. conv_state (K-1, channels) and state (nv, dk, dv) are
    advanced in place; conv_w (K, channels), tap K-1 on this token. Returns the gated, normalised
    output (nv·dv,) float32 for the output projection, as `Qwen35Model._deltanet` computes it."""
    out = torch.empty(state.shape[0] * state.shape[2], dtype=torch.float32)
    _token(proj.contiguous().numpy(), conv_state.numpy(), conv_w.numpy(), a.numpy(), dt_bias.numpy(),
           norm_w.numpy(), state.numpy(), nk, np.float32(eps), np.float32(l2_eps), out.numpy())
    return out


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor:
    """One token: q, k (nk, dk); v (nv, dv); g (log decay), beta (nv,); state (nv, dk, dv), all
    float32 on the CPU, state contiguous and advanced in place. Value head j reads key head
    j mod nk. S = e^g·S₀ + k δᵀ with δ = β(v − e^g·S₀ᵀk); returns o = Sᵀq = e^g·S₀ᵀq + (k·q)δ, (nv, dv)."""
    out = torch.empty(v.shape, dtype=torch.float32)
    _step(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), g.exp().contiguous().numpy(),
          beta.contiguous().numpy(), state.numpy(), out.numpy())
    return out
