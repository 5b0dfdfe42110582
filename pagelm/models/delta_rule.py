"""One token of Qwen3.5's DeltaNet mixer as compiled kernels over its states in place.

Owns the decode path on the CPU between the input projection and the output projection: the
gated delta rule step alone (`delta_rule_step`), and the whole token of one or more sequences
(`deltanet_tokens`: causal conv and SiLU, L2 norms, gates, the step, the gated RMS norm). torch
spends a millisecond per layer on the step's five small ops over the state, and ~25 dispatches on
the rest; one pass to read the state and one to update it take a few microseconds per head. A
batched step's sequences share one call (one parallel region per part, not one per sequence).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, prange

from pagelm.models.token_ops import pointer
from pagelm.quant.codegen import fma
from pagelm.quant.precompile import Job


@njit(cache=True)
def _advance_head(state, k, q, v, e, b, out):
    """One value head: state (dk, dv) ← e·state + k δᵀ with δ = b(v − e·stateᵀk); out ← e·stateᵀq + (k·q)δ
    from one read of the old state. Each multiply-add an explicit FMA and nothing else contracted:
    the same bits whether numba compiled the kernel in this process or loaded it from its cache
    (with fastmath's contraction left to LLVM, those two differed)."""
    dk, dv = state.shape
    read_k = np.zeros(dv, np.float32)
    read_q = np.zeros(dv, np.float32)
    kq = np.float32(0)
    for i in range(dk):
        ki, qi = k[i], q[i]
        kq = fma(ki, qi, kq)
        for j in range(dv):
            s = state[i, j]
            read_k[j] = fma(s, ki, read_k[j])
            read_q[j] = fma(s, qi, read_q[j])
    delta = read_k  # reused
    for j in range(dv):
        delta[j] = fma(-e, read_k[j], v[j]) * b
        out[j] = fma(kq, delta[j], e * read_q[j])
    for i in range(dk):
        ki = k[i]
        for j in range(dv):
            state[i, j] = fma(ki, delta[j], e * state[i, j])


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


# Channels a task of the conv: runs long enough for vector loops, enough of them for every thread
# at one sequence (Qwen3.5's 0.8B has 6,144 channels: 12 runs).
_CONV_RUN = 512


@njit(cache=True, fastmath={"contract"})
def _conv_silu(conv_state, conv_w, p, x):
    """x ← SiLU of each channel's depthwise causal conv over the last taps inputs (conv_state's rows)
    and this one, p; the window moves on by p. One run of channels (a call: see token_ops.pointer),
    each loop over the run a vector loop, each channel's sum in tap order as alone."""
    taps, width = conv_state.shape[0], x.shape[0]
    for c in range(width):
        x[c] = p[c] * conv_w[taps, c]
    for j in range(taps):
        for c in range(width):
            x[c] += conv_state[j, c] * conv_w[j, c]
    for j in range(taps - 1):
        for c in range(width):
            conv_state[j, c] = conv_state[j + 1, c]
    for c in range(width):
        conv_state[taps - 1, c] = p[c]
        x[c] = x[c] * _sigmoid(x[c])


@njit(cache=True)
def _copy_into(dst, src):
    """dst = src (2-D, one shape): a call, so that writes through a prange body's pointer arrays are kept."""
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            dst[i, j] = src[i, j]


@njit(parallel=True, cache=True, fastmath={"contract"})
def _tokens(proj, order, starts, convs, conv_keeps, conv_w, a, dt_bias, norm_w, states, state_keeps, nk, dk, dv, eps,
            l2_eps, out):
    """Rows order[starts[s] : starts[s + 1]] of proj, in that order, are sequence s's tokens, its window at
    convs[s] and state at states[s]; after row i, conv_keeps[i] and state_keeps[i] (addresses; 0: none) get
    copies of them. Each sequence's rows go in order inside each task (a run of channels, a value head), so
    one call takes a whole verify pass, each row's arithmetic what it is alone."""
    n = proj.shape[0]
    taps, channels = conv_w.shape[0] - 1, conv_w.shape[1]
    nv = a.shape[0]
    values = nv * dv
    x = np.empty((n, channels), np.float32)
    runs = (channels + _CONV_RUN - 1) // _CONV_RUN
    sequences = starts.shape[0] - 1
    for sr in prange(sequences * runs):
        s, lo = sr // runs, sr % runs * _CONV_RUN
        hi = min(lo + _CONV_RUN, channels)
        window = carray(pointer(convs[s], proj), (taps, channels))[:, lo:hi]
        for t in range(starts[s], starts[s + 1]):
            i = order[t]
            _conv_silu(window, conv_w[:, lo:hi], proj[i, lo:hi], x[i, lo:hi])
            if conv_keeps[i] != 0:
                _copy_into(carray(pointer(conv_keeps[i], proj), (taps, channels))[:, lo:hi], window)
    q_scale = np.float32(dk ** -0.5)
    for sh in prange(n * 2 * nk):  # q heads then k heads, L2-normalised; q scaled too
        s, head = sh // (2 * nk), sh % (2 * nk)
        base = head * dk
        ss = np.float32(0)
        for i in range(dk):
            ss += x[s, base + i] * x[s, base + i]
        r = np.float32(1) / np.sqrt(ss + l2_eps)
        if head < nk:
            r *= q_scale
        for i in range(dk):
            x[s, base + i] *= r
    k0, v0 = nk * dk, 2 * nk * dk
    for sh in prange(sequences * nv):
        s, h = sh // nv, sh % nv
        kh = h % nk
        state = carray(pointer(states[s], proj), (nv, dk, dv))[h]
        for t in range(starts[s], starts[s + 1]):
            i = order[t]
            b = _sigmoid(proj[i, channels + values + h])
            e = np.exp(a[h] * _softplus(proj[i, channels + values + nv + h] + dt_bias[h]))
            o = out[i, h * dv:(h + 1) * dv]
            xs = x[i]
            _advance_head(state, xs[k0 + kh * dk:k0 + (kh + 1) * dk], xs[kh * dk:(kh + 1) * dk],
                          xs[v0 + h * dv:v0 + (h + 1) * dv], e, b, o)
            if state_keeps[i] != 0:
                _copy_into(carray(pointer(state_keeps[i], proj), (nv, dk, dv))[h], state)
            ss = np.float32(0)
            for j in range(dv):
                ss += o[j] * o[j]
            r = np.float32(1) / np.sqrt(ss / np.float32(dv) + eps)
            for j in range(dv):
                z = proj[i, channels + h * dv + j]
                o[j] = o[j] * r * norm_w[j] * (z * _sigmoid(z))


def _f32_cpu(t: torch.Tensor, shape: tuple) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and tuple(t.shape) == shape


def _addresses(keeps: list, part: int) -> np.ndarray:
    """The data address of each row's keep's tensor `part` (0: the window, 1: the state); 0 where it has none."""
    return np.array([0 if k is None else k[part].data_ptr() for k in keeps], np.int64)


def deltanet_tokens(proj: torch.Tensor, convs: list[torch.Tensor], conv_w: torch.Tensor, a: torch.Tensor,
                    dt_bias: torch.Tensor, norm_w: torch.Tensor, states: list[torch.Tensor], nk: int, eps: float,
                    l2_eps: float, sequence_of: list[int] | None = None,
                    keeps: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None) -> torch.Tensor | None:
    """One token of the mixer for each row of `proj` (n, channels + nv·dv + 2·nv) float32, each row
    [q k v for the conv | z | beta | alpha], as one kernel: row i is a token of sequence sequence_of[i]
    (default: sequence i), a sequence's rows its consecutive tokens in row order. Sequence j's conv_state
    convs[j] (K-1, channels) and state states[j] (nv, dk, dv) are advanced in place; conv_w (K, channels),
    tap K-1 on this token; keeps[i], where given and not None, (conv, state) copies that get the window and
    state after row i (a verify pass's `Trail`). Returns the gated, normalised outputs (n, nv·dv) float32 for
    the output projection, as `Qwen35Model._deltanet` computes them, each row's bits those of its token
    decoded alone; None for inputs the kernel does not take (not float32, contiguous CPU states of one
    shape)."""
    n, (taps, channels), (nv, dk, dv) = proj.shape[0], convs[0].shape, states[0].shape
    sequence_of = list(range(n)) if sequence_of is None else sequence_of
    keeps = [None] * n if keeps is None else keeps
    copies = [t for k in keeps if k is not None for t in k]
    if not (len(convs) == len(states) and len(sequence_of) == len(keeps) == n
            and sorted(set(sequence_of)) == list(range(len(states)))
            and proj.shape[1] == channels + nv * dv + 2 * nv and proj.dtype == torch.float32 and proj.device.type == "cpu"
            and all(_f32_cpu(c, (taps, channels)) for c in [*convs, *copies[0::2]])
            and all(_f32_cpu(s, (nv, dk, dv)) for s in [*states, *copies[1::2]])):
        return None
    order = np.argsort(np.asarray(sequence_of, np.int64), kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(sequence_of, minlength=len(states)))]).astype(np.int64)
    out = torch.empty(n, nv * dv, dtype=torch.float32)
    _tokens(proj.contiguous().numpy(), order, starts, np.array([c.data_ptr() for c in convs], np.int64),
            _addresses(keeps, 0), conv_w.numpy(), a.numpy(), dt_bias.numpy(), norm_w.numpy(),
            np.array([s.data_ptr() for s in states], np.int64), _addresses(keeps, 1), nk, dk, dv, np.float32(eps),
            np.float32(l2_eps), out.numpy())
    return out


def warmup_job() -> Job:
    """The worker job (quant.precompile.Job) of `warmup`."""
    return Job(__name__, "warmup", (), (_tokens,), "", cost=4.0)


def warmup() -> None:
    """Compiles (or loads) deltanet_tokens' kernel: one token of one sequence with one head of 2, as a decode
    step calls it (a verify pass calls the same kernel)."""
    nk, dk, dv, taps = 1, 2, 2, 4
    channels = 2 * nk * dk + dv
    if deltanet_tokens(torch.zeros(1, channels + dv + 2), [torch.zeros(taps - 1, channels)], torch.zeros(taps, channels),
                       torch.zeros(1), torch.zeros(1), torch.ones(dv), [torch.zeros(1, dk, dv)], nk, 1e-6, 1e-6) is None:
        raise AssertionError("deltanet_tokens did not take its warmup token")


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor:
    """One token: q, k (nk, dk); v (nv, dv); g (log decay), beta (nv,); state (nv, dk, dv), all
    float32 on the CPU, state contiguous and advanced in place. Value head j reads key head
    j mod nk. S = e^g·S₀ + k δᵀ with δ = β(v − e^g·S₀ᵀk); returns o = Sᵀq = e^g·S₀ᵀq + (k·q)δ, (nv, dv)."""
    out = torch.empty(v.shape, dtype=torch.float32)
    _step(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), g.exp().contiguous().numpy(),
          beta.contiguous().numpy(), state.numpy(), out.numpy())
    return out
