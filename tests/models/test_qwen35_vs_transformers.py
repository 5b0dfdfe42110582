"""pagelm's qwen35 against transformers' Qwen3_5ForCausalLM on tiny random models, via GGUF."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from qwen35_hf import VARIANTS, Variant, build_hf_model, hf_logits, hf_to_gguf

from pagelm.errors import ModelFormatError, PagelmError
from pagelm.formats.gguf import GGUFFile
from pagelm.models.qwen35 import (
    Qwen35Config,
    Qwen35Model,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from pagelm.quant import decode_f32
from pagelm.quant.types import GGMLType
from pagelm.weights.loader import WeightLoader, dequantize_tensor

PROMPT = 64
TOL = 1e-3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py


@dataclass
class Case:
    variant: Variant
    weights: str  # "mapped" or "dense"
    hf: torch.nn.Module
    path: str
    model: Qwen35Model
    table: torch.Tensor  # token_embd, (vocab, hidden) fp32
    ids: torch.Tensor
    ref: torch.Tensor  # transformers' logits (PROMPT, vocab)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.table.T

    def decode(self, model: Qwen35Model, state, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.logits(model.forward(self.embed(ids[i : i + 1]), state)) for i in range(len(ids))])


def open_model(path, weights: str = "mapped", dtype: torch.dtype = torch.float32) -> Qwen35Model:
    loader = WeightLoader(GGUFFile.open(path), weights, dtype)
    return Qwen35Model(Qwen35Config.from_loader(loader), loader)


@pytest.fixture(scope="module", params=[(v, w) for v in VARIANTS for w in ("mapped", "dense")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory) -> Case:
    v, weights = VARIANTS[request.param[0]], request.param[1]
    hf = build_hf_model(v)
    path = str(tmp_path_factory.mktemp(v.name) / "model.gguf")
    hf_to_gguf(hf, path)
    gguf = GGUFFile.open(path)
    model = open_model(path, weights)
    table = dequantize_tensor(gguf, "token_embd.weight")
    ids = torch.randint(0, v.vocab, (PROMPT,), generator=torch.Generator().manual_seed(7))
    return Case(v, weights, hf, path, model, table, ids, hf_logits(hf, ids))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------ against HF


def test_config_from_gguf(case: Case):
    c, hc = case.model.config, case.hf.config
    assert (c.hidden, c.n_layers, c.ffn, c.vocab) == (hc.hidden_size, hc.num_hidden_layers, hc.intermediate_size, hc.vocab_size)
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert c.rope_dim == int(hc.head_dim * hc.rope_parameters["partial_rotary_factor"])
    assert c.rope_base == hc.rope_parameters["rope_theta"]
    assert (c.n_key_heads, c.n_value_heads) == (hc.linear_num_key_heads, hc.linear_num_value_heads)
    assert (c.linear_key_dim, c.linear_value_dim) == (hc.linear_key_head_dim, hc.linear_value_head_dim)
    assert [c.is_attention_layer(i) for i in range(c.n_layers)] == [t == "full_attention" for t in hc.layer_types]


def test_reference_is_not_degenerate(case: Case):
    assert case.ref.std().item() > 1.0
    assert len(set(case.ref.argmax(-1).tolist())) > PROMPT // 4


def test_prefill_matches_transformers(case: Case):
    state = case.model.new_state(PROMPT)
    h = case.model.forward(case.embed(case.ids), state)
    assert h.dtype == torch.float32 and h.shape == (PROMPT, case.variant.hidden)
    assert state.pos == PROMPT
    assert max_diff(case.logits(h), case.ref) <= TOL


def test_decode_matches_transformers(case: Case):
    state = case.model.new_state(PROMPT)
    assert max_diff(case.decode(case.model, state, case.ids), case.ref) <= TOL
    assert state.pos == PROMPT


def test_prefill_in_pieces_matches_transformers(case: Case):
    """T > 1 at pos > 0 (masked attention over the cache), and the model's own segmenting."""
    model = case.model
    state = model.new_state(PROMPT)
    first = case.logits(model.forward(case.embed(case.ids[:40]), state))
    second = case.logits(model.forward(case.embed(case.ids[40:]), state))
    assert max_diff(torch.cat((first, second)), case.ref) <= TOL
    model.segment = 24
    try:
        state = model.new_state(PROMPT)
        assert max_diff(case.logits(model.forward(case.embed(case.ids), state)), case.ref) <= TOL
    finally:
        del model.segment


def test_checkpoint_restore_matches_transformers(case: Case):
    model, ids = case.model, case.ids
    state = model.new_state(PROMPT + 16)
    prefill = case.logits(model.forward(case.embed(ids[:40]), state))
    assert max_diff(prefill, case.ref[:40]) <= TOL
    ckpt = state.checkpoint()
    assert ckpt.pos == 40
    detour = torch.randint(0, case.variant.vocab, (10,), generator=torch.Generator().manual_seed(3))
    case.decode(model, state, detour)
    assert state.pos == 50
    state.restore(ckpt)
    assert state.pos == 40
    rest = case.decode(model, state, ids[40:])
    assert max_diff(rest, case.ref[40:]) <= TOL

    # bit-identical to never having taken the detour
    straight = model.new_state(PROMPT + 16)
    model.forward(case.embed(ids[:40]), straight)
    assert torch.equal(case.decode(model, straight, ids[40:]), rest)

    # a checkpoint holds KV[:pos] of attention layers and every DeltaNet state
    c = model.config
    n_attn = sum(c.is_attention_layer(i) for i in range(c.n_layers))
    kv = n_attn * 2 * c.n_kv_heads * 40 * c.head_dim * 4
    dn = (c.n_layers - n_attn) * 4 * (c.conv_channels * (c.conv_kernel - 1)
                                      + c.n_value_heads * c.linear_key_dim * c.linear_value_dim)
    assert ckpt.nbytes == kv + dn
    assert dn < state.nbytes <= kv // 40 * (PROMPT + 16) + dn  # the KV pages written so far, at most all reserved


def test_restore_rejects_a_foreign_checkpoint(case: Case):
    state = case.model.new_state(8)
    case.model.forward(case.embed(case.ids[:8]), state)
    ckpt = state.checkpoint()
    small = case.model.new_state(4)
    with pytest.raises(PagelmError, match="max_len"):
        small.restore(ckpt)


def test_bf16_stays_close(case: Case):
    """bf16 matmuls: as close to the fp32 reference as transformers' own bf16 model is."""
    import copy

    hf_bf16 = hf_logits(copy.deepcopy(case.hf).to(torch.bfloat16), case.ids)
    budget = 1.5 * (hf_bf16 - case.ref).abs().mean().item()
    scale = case.ref.abs().max().item()
    model = open_model(case.path, case.weights, torch.bfloat16)
    assert all(layer.mlp.gate_up.dtype == torch.bfloat16 for layer in model.layers)
    state = model.new_state(PROMPT)
    prefill = case.logits(model.forward(case.embed(case.ids).to(torch.bfloat16), state))
    decode = case.decode(model, model.new_state(PROMPT), case.ids)
    for got in (prefill, decode):
        assert got.dtype == torch.float32
        assert (got - case.ref).abs().mean().item() <= budget
        assert max_diff(got, case.ref) <= 0.25 * scale
        assert (got.argmax(-1) == case.ref.argmax(-1)).float().mean().item() >= 0.75


def test_exceeding_max_len_raises(case: Case):
    state = case.model.new_state(8)
    with pytest.raises(PagelmError, match=r"pos 0 \+ 9 tokens exceeds the state's max_len 8"):
        case.model.forward(case.embed(case.ids[:9]), state)
    assert state.pos == 0
    case.model.forward(case.embed(case.ids[:8]), state)
    with pytest.raises(PagelmError, match=r"pos 8 \+ 1 tokens exceeds the state's max_len 8"):
        case.model.forward(case.embed(case.ids[8:9]), state)
    assert state.pos == 8


# ------------------------------------------------------------------------------ file errors


@pytest.fixture(scope="module")
def tiny_hf():
    return build_hf_model(VARIANTS["tiled_heads"], seed=1)


@pytest.mark.parametrize("key", [
    "qwen35.rope.freq_base",
    "qwen35.rope.dimension_count",
    "qwen35.ssm.group_count",
    "qwen35.ssm.inner_size",
    "qwen35.full_attention_interval",
    "qwen35.attention.layer_norm_rms_epsilon",
])
def test_missing_metadata_key_is_a_format_error(tiny_hf, tmp_path, key):
    path = tmp_path / "model.gguf"
    hf_to_gguf(tiny_hf, path, drop_keys=(key,))
    with GGUFFile.open(path) as gguf, pytest.raises(ModelFormatError, match=key.replace(".", r"\.")):
        Qwen35Config.from_loader(WeightLoader(gguf))


@pytest.mark.parametrize("name", ["blk.0.ssm_a", "blk.2.attn_q_norm.weight", "blk.1.ffn_up.weight", "output_norm.weight"])
def test_missing_tensor_is_a_format_error(tiny_hf, tmp_path, name):
    path = tmp_path / "model.gguf"
    hf_to_gguf(tiny_hf, path, drop_tensors=(name,))
    with GGUFFile.open(path) as gguf:
        loader = WeightLoader(gguf)
        config = Qwen35Config.from_loader(loader)
        with pytest.raises(ModelFormatError, match=name.replace(".", r"\.")):
            Qwen35Model(config, loader)


def test_wrong_architecture_is_a_format_error(tmp_path):
    from pagelm.formats.gguf import write_gguf

    path = tmp_path / "llama.gguf"
    write_gguf(path, {"general.architecture": "llama"}, [])
    with GGUFFile.open(path) as gguf, pytest.raises(ModelFormatError, match="qwen35"):
        Qwen35Config.from_loader(WeightLoader(gguf))


# ------------------------------------------------------------------------------ loading


def test_dequantize_tensor_q8_0(tiny_hf, tmp_path, monkeypatch):
    import pagelm.weights.loader as loading

    path = tmp_path / "q8.gguf"
    hf_to_gguf(tiny_hf, path, matrix_type=GGMLType.Q8_0)
    monkeypatch.setattr(loading, "DECODE_CHUNK_VALUES", 1000)  # several chunks per tensor
    with GGUFFile.open(path) as gguf:
        name = "blk.0.attn_qkv.weight"
        info = gguf.tensors[name]
        assert info.ggml_type == GGMLType.Q8_0
        want = decode_f32(gguf.tensor_data(name).reshape(info.shape[0], -1), GGMLType.Q8_0)
        got = dequantize_tensor(gguf, name)
        assert got.shape == info.shape and got.dtype == torch.float32
        assert np.array_equal(got.numpy(), want)
        got16 = dequantize_tensor(gguf, name, torch.bfloat16)
        assert torch.equal(got16, torch.from_numpy(want).to(torch.bfloat16))
        with pytest.raises(ModelFormatError, match="no_such"):
            dequantize_tensor(gguf, "blk.0.no_such.weight")
        with pytest.raises(ModelFormatError, match="shape"):
            dequantize_tensor(gguf, name, shape=(1, 2))

        # a Q8_0 model holds exactly the decoded weights (fused), runs, and stays near the reference
        model = open_model(path, "dense")
        assert torch.equal(model.layers[0].mixer.in_proj.weight[: info.shape[0]], got)
        up = dequantize_tensor(gguf, "blk.1.ffn_up.weight")
        assert torch.equal(model.layers[1].mlp.gate_up.weight[up.shape[0] :], up)
        table = dequantize_tensor(gguf, "token_embd.weight")
    ids = torch.arange(32) * 7 % 512
    ref = hf_logits(tiny_hf, ids)
    got = model.forward(table[ids], model.new_state(32)) @ table.T
    assert (got - ref).abs().mean().item() <= 0.03 * ref.abs().max().item()


# ------------------------------------------------------------------------------ delta rule


@pytest.mark.parametrize("nk,nv", [(2, 2), (2, 4)])
@pytest.mark.parametrize("T", [2, 37, 64, 100, 150])
def test_chunked_delta_rule_equals_recurrence(T, nk, nv):
    gen = torch.Generator().manual_seed(T * 10 + nv)
    dk, dv = 16, 24
    q = torch.nn.functional.normalize(torch.randn(T, nk, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(T, nk, dk, generator=gen), dim=-1)
    v = torch.randn(T, nv, dv, generator=gen)
    g = -torch.rand(T, nv, generator=gen) * 0.5
    beta = torch.rand(T, nv, generator=gen)
    s0 = torch.randn(nv, dk, dv, generator=gen) * 0.3
    s_rec, s_chunk = s0.clone(), s0.clone()
    o_rec = gated_delta_rule_recurrent(q, k, v, g, beta, s_rec)
    o_chunk = gated_delta_rule_chunked(q, k, v, g, beta, s_chunk)
    assert o_chunk.shape == (T, nv, dv)
    assert max_diff(o_chunk, o_rec) <= 1e-4
    assert max_diff(s_chunk, s_rec) <= 1e-4
    # value head j reads key head j mod nk: with nv = 2·nk, heads j and j + nk share keys
    if nv == 2 * nk:
        s_one = s0[:nk].clone()
        o_one = gated_delta_rule_recurrent(q, k, v[:, :nk], g[:, :nk], beta[:, :nk], s_one)
        assert max_diff(o_one, o_rec[:, :nk]) <= 1e-5


def test_recurrence_matches_the_definition():
    """One explicit step of S = e^g·S; δ = β(v − Sᵀk); S += k δᵀ; o = Sᵀq."""
    gen = torch.Generator().manual_seed(0)
    nk, nv, dk, dv = 1, 2, 8, 4
    q, k = torch.randn(1, nk, dk, generator=gen), torch.randn(1, nk, dk, generator=gen)
    v, g, beta = torch.randn(1, nv, dv, generator=gen), -torch.rand(1, nv, generator=gen), torch.rand(1, nv, generator=gen)
    s = torch.randn(nv, dk, dv, generator=gen)
    want_s, want_o = s.clone(), torch.empty(nv, dv)
    for j in range(nv):
        S = torch.exp(g[0, j]) * want_s[j]
        delta = beta[0, j] * (v[0, j] - S.T @ k[0, 0])
        S = S + torch.outer(k[0, 0], delta)
        want_s[j], want_o[j] = S, S.T @ q[0, 0]
    o = gated_delta_rule_recurrent(q, k, v, g, beta, s)
    assert max_diff(o[0], want_o) <= 1e-5 and max_diff(s, want_s) <= 1e-5
