"""qwen3moe against transformers' own tiny random Qwen3MoeForCausalLM: its save_pretrained directories
(float32, bf16) read in place match it; they and its GGUF (tests/hf_gguf.py; test_llama_family_vs_transformers.py
runs the GGUFs' logits, greedy tokens and batched bits in F32, Q8_0 and MXFP4) route every token to the
experts transformers routes it to; a batched decode whose sequences share experts and part ways is each
one's own bits; checkpoints and the prefix cache are recomputing; the experts stay in the file; the
GGUF's Hugging Face twin is transformers'; files that disagree with themselves are refused by name."""

from __future__ import annotations

import copy
from dataclasses import replace

import gguf

import numpy as np
import pytest
import torch

import pagelm
from pagelm.errors import ModelFormatError, PagelmError
from pagelm.quant.types import GGMLType
from pagelm.tools.convert import write_directory
from pagelm.tools.synth import SHAPES, write_model
from pagelm.weights.linear import MappedLinear
from pagelm.weights.mapped import MappedTensor

from hf_gguf import tiny_decoder, write_decoder_gguf
from moe_checks import changed_directory, check_restores, check_routes, check_sharing_and_parting
from hf_oracle import F32_REL_TOL, PROMPT, check_greedy, greedy, rel

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, transformers float32 model computing what it holds): save_pretrained directories
    of a model that does not renormalize its top-k (transformers' default), in float32 and in bf16 (as
    the real checkpoints are), and an F32 GGUF of one that does (as llama.cpp's qwen3moe always does)."""
    root = tmp_path_factory.mktemp("qwen3moe")
    directory = tiny_decoder("qwen3moe-untied", norm_topk_prob=False)
    directory.save_pretrained(root / "hf")
    copy.deepcopy(directory).to(torch.bfloat16).save_pretrained(root / "hf-bf16")
    bf16 = copy.deepcopy(directory)  # float32, with the bf16 values (its rope tables stay float32's)
    bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in bf16.state_dict().items()})
    gguf = tiny_decoder("qwen3moe-untied")
    write_decoder_gguf(gguf, str(root / "f32.gguf"), "qwen3moe")
    return {"hf": (str(root / "hf"), directory), "hf-bf16": (str(root / "hf-bf16"), bf16),
            "gguf": (str(root / "f32.gguf"), gguf)}




@pytest.mark.parametrize("name, weights", [("hf", "mapped"), ("hf", "dense"), ("hf-bf16", "mapped")])
def test_the_directory_in_place_matches_transformers(checkpoints, name, weights):
    path, reference = checkpoints[name]
    model = pagelm.load(path, weights=weights, dtype="float32")
    tokens, logits = greedy(model, PROMPT)
    check_greedy(reference, PROMPT, tokens, logits, F32_REL_TOL)
    with torch.inference_mode():
        ref = reference(torch.tensor([PROMPT])).logits[0].numpy()
    session = model.session(len(PROMPT))
    rows = [session.prefill(PROMPT[:3])] + [session.decode(t) for t in PROMPT[3:]]
    assert max(rel(row, r) for row, r in zip(rows, ref[2:])) <= F32_REL_TOL


@pytest.mark.parametrize("name", ["hf", "gguf"])
def test_every_token_is_routed_as_transformers_routes_it(checkpoints, name):
    """The prefill's tokens and each decoded one go to transformers' top-k experts, in its order."""
    path, reference = checkpoints[name]
    check_routes(pagelm.load(path, dtype="float32"), reference, PROMPT)



@pytest.mark.parametrize("weights, dtype", [("mapped", "float32"), ("dense", "float32")])
def test_sequences_sharing_and_parting_experts_decode_their_own_bits(checkpoints, weights, dtype):
    check_sharing_and_parting(pagelm.load(checkpoints["gguf"][0], weights=weights, dtype=dtype), PROMPT)


def test_a_restored_checkpoint_and_the_prefix_cache_are_recomputing(checkpoints):
    """A session brought back from a detour, and one the prefix cache restores a prompt into, decode
    the bits of a session that computed the prompt itself."""
    check_restores(pagelm.load(checkpoints["gguf"][0], dtype="float32"), PROMPT, [1, 2, 3, 4, 5])


def test_the_experts_are_read_in_place(checkpoints, monkeypatch):
    """In mapped mode each expert's operator reads its rows where the file map holds them, the row
    offsets one array for all, and the weights' anonymous memory holds no expert; the load asks the
    OS for the other matrices' pages, not for the experts' (a token reads only its own experts')."""
    path = checkpoints["gguf"][0]
    advised = []
    advise = MappedTensor.advise
    monkeypatch.setattr(MappedTensor, "advise", lambda self, *a: advised.append(self.name) or advise(self, *a))
    model = pagelm.load(path, dtype="float32")
    assert "blk.0.attn_q.weight" in advised and not [name for name in advised if "_exps." in name]
    file = model.loader.file
    buffer = file.tensor_buffer("blk.0.ffn_gate_exps.weight")[0]
    experts = model.network.layers[0].experts
    info = file.tensors["blk.0.ffn_down_exps.weight"]
    per_expert = info.nbytes // info.shape[0]
    for e, op in enumerate(experts.down):
        assert isinstance(op, MappedLinear)
        (part,) = op.parts
        assert np.shares_memory(part.data, buffer) and part.data.size == per_expert
        assert part.data.ctypes.data == buffer.ctypes.data + info.offset + e * per_expert
        assert part.offsets is experts.down[0].parts[0].offsets
    assert list(experts.down[0].parts[0].offsets) == [r * info.row_nbytes for r in range(info.shape[1])]
    expert_bytes = sum(t.nbytes for name, t in file.tensors.items() if "_exps." in name)
    assert model.loader.nbytes < expert_bytes / 4
    dense = pagelm.load(path, weights="dense", dtype="float32")
    assert dense.loader.nbytes > expert_bytes  # what mapped mode does not copy


def _transformers_of_gguf(path: str, shape):
    """A transformers Qwen3MoeForCausalLM holding a synthetic qwen3moe GGUF's values, as gguf-py decodes them."""
    import transformers

    values = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
              for t in gguf.GGUFReader(path).tensors}
    config = transformers.Qwen3MoeConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_head, num_key_value_heads=shape.n_head_kv, head_dim=shape.head_dim,
        num_experts=shape.n_experts, num_experts_per_tok=shape.n_experts_used, moe_intermediate_size=shape.expert_ffn,
        norm_topk_prob=True, rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_eps, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    held = {"model.embed_tokens.weight": values["token_embd.weight"], "lm_head.weight": values["output.weight"],
            "model.norm.weight": values["output_norm.weight"]}
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate"}
    for i in range(shape.n_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        held.update({p + hf + ".weight": values[b + name + ".weight"] for name, hf in names.items()})
        held[p + "mlp.experts.gate_up_proj"] = torch.cat([values[b + "ffn_gate_exps.weight"],
                                                         values[b + "ffn_up_exps.weight"]], 1)
        held[p + "mlp.experts.down_proj"] = values[b + "ffn_down_exps.weight"]
    model.load_state_dict(held)
    return model


def test_k_quant_experts_match_transformers_on_their_values(tmp_path):
    """A synthetic Q4_K_M qwen3moe (Q4_K experts, Q6_K ffn_down_exps in a bumped layer, as the real
    files are) in every weights mode against transformers on the values gguf-py decodes."""
    shape = replace(SHAPES["qwen3-30b-a3b-tiny"], hidden=256, expert_ffn=256)
    path = str(tmp_path / "q4_k_m.gguf")
    plan = {t.name: t.ggml_type for t in write_model(path, shape, seed=1, mix="q4_k_m")}
    assert {plan["blk.0.ffn_gate_exps.weight"], plan["blk.0.ffn_down_exps.weight"]} == {GGMLType.Q4_K}
    assert plan["blk.1.ffn_down_exps.weight"] == GGMLType.Q6_K
    reference = _transformers_of_gguf(path, shape)
    for weights in ("mapped", "dense"):
        tokens, logits = greedy(pagelm.load(path, weights=weights, dtype="float32"), PROMPT, steps=8)
        check_greedy(reference, PROMPT, tokens, logits, F32_REL_TOL)


def test_the_ggufs_hugging_face_twin_is_read_by_transformers_the_same_way(checkpoints, tmp_path):
    """pagelm's GGUF → Hugging Face writer splits each 3-D expert tensor into transformers' per-expert
    tensors and writes the experts' config keys (top-k renormalized, as the GGUF's)."""
    import transformers

    path, reference = checkpoints["gguf"]
    twin = str(tmp_path / "twin")
    write_directory(path, twin, "hf", quantized="f32")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    assert loaded.config.norm_topk_prob is True and loaded.config.num_experts == 8
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0].numpy()
        assert rel(loaded(torch.tensor([PROMPT])).logits[0].numpy(), want) <= F32_REL_TOL
    assert rel(pagelm.load(twin, dtype="float32").session(32).prefill(PROMPT), want[-1]) <= F32_REL_TOL


@pytest.mark.parametrize("key, value, words", [
    ("num_experts", 6, r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \(8, 32, 64\).*expected \(6, 32, 64\)"),
    ("num_experts_per_tok", 9, r"expert_used_count 9 exceeds expert_count 8"),
])
def test_expert_counts_unlike_the_file_are_named(tmp_path, key, value, words):
    model = tiny_decoder("qwen3moe-untied")
    setattr(model.config, key, value)  # the metadata says so; the tensors hold 8 experts
    path = str(tmp_path / "bad.gguf")
    write_decoder_gguf(model, path, "qwen3moe", GGMLType.F32)
    with pytest.raises(ModelFormatError, match=words):
        pagelm.load(path)


@pytest.mark.parametrize("change, words", [
    ({"mlp_only_layers": [1]}, "dense feed-forward layers among the expert ones"),
    ({"norm_topk_prob": "yes"}, "key 'norm_topk_prob' is 'yes', expected true or false"),
])
def test_a_directory_pagelm_cannot_read_as_it_says_is_refused_by_name(checkpoints, tmp_path, change, words):
    with pytest.raises(PagelmError, match=words):
        pagelm.load(str(changed_directory(checkpoints["hf"][0], tmp_path, change)))
