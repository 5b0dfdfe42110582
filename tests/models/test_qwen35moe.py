"""qwen35moe against transformers' own tiny random Qwen3_5MoeForCausalLM: its save_pretrained directories
(float32, bf16) read in place and its llama.cpp-form GGUFs (tests/models/qwen35_hf.py: F32, and Q8_0 against
transformers run on the values gguf-py decodes) give its logits in prefill and decode and its greedy tokens,
and route every token to the experts transformers routes it to; a batched decode whose sequences share
experts and part ways is each one's own bits; checkpoints and the prefix cache are recomputing; the experts
stay in the file; the GGUF's Hugging Face twin is transformers'; files that disagree with themselves are
refused by name."""

from __future__ import annotations

import copy

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

from moe_checks import changed_directory, check_restores, check_routes, check_sharing_and_parting, same_bits
from hf_oracle import F32_REL_TOL, PROMPT, check_greedy, greedy, rel

pytest.importorskip("transformers")
from qwen35_hf import Variant, build_hf_model, hf_to_gguf  # noqa: E402 (needs transformers)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

# attention in layers 1 and 3, DeltaNet with twice as many value heads as key heads (GGUF's tiled order)
# in 0 and 2; 8 experts, 2 per token, and a shared expert; every row width whole Q8_0 blocks
TINY = Variant("moe", hidden=64, layers=4, interval=2, ffn=0, heads=4, kv_heads=2, head_dim=32, partial_rotary=0.5,
               rope_theta=10_000.0, key_heads=2, value_heads=4, linear_dim=32, vocab=256, experts=(8, 2, 32, 64))
# the float32 sums of transformers and pagelm differ in order only, but these random weights amplify
# that: with seed 0 one decode step's logits move by 6e-6 (relative) when ssm_a = -exp(A_log) moves by
# one ulp (numpy's exp against torch's), which leaves no margin under 1e-5; seed 2's worst is 3e-6
SEED = 2


def _gguf_values(model, matrix_type: GGMLType):
    """A copy of `model` holding what hf_to_gguf's `matrix_type` file holds: each matrix it quantizes
    (the layers' 2-D and 3-D matrices and the untied head; not the router, the shared expert's gate,
    in_proj_a/b or the conv taps) encoded and decoded by gguf-py, row by row."""
    held = copy.deepcopy(model)
    kept = ("embed_tokens.weight", "in_proj_a.weight", "in_proj_b.weight", "mlp.gate.weight",
            "shared_expert_gate.weight", "conv1d.weight")
    qtype = gguf.GGMLQuantizationType[matrix_type.name]
    with torch.no_grad():
        for name, p in held.named_parameters():
            if p.dim() in (2, 3) and not name.endswith(kept):
                rows = p.detach().reshape(-1, p.shape[-1]).numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, qtype), qtype)).view(p.shape))
    return held


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, transformers float32 model computing what it holds)."""
    root = tmp_path_factory.mktemp("qwen35moe")
    model = build_hf_model(TINY, SEED)
    model.save_pretrained(root / "hf")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(root / "hf-bf16")
    bf16 = copy.deepcopy(model)  # float32, with the bf16 values
    bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in bf16.state_dict().items()})
    hf_to_gguf(model, str(root / "f32.gguf"))
    q8 = _gguf_values(model, GGMLType.Q8_0)
    hf_to_gguf(model, str(root / "q8_0.gguf"), matrix_type=GGMLType.Q8_0)
    return {"hf": (str(root / "hf"), model), "hf-bf16": (str(root / "hf-bf16"), bf16),
            "gguf": (str(root / "f32.gguf"), model), "q8_0": (str(root / "q8_0.gguf"), q8)}




@pytest.mark.parametrize("name, weights", [("hf", "mapped"), ("hf", "dense"), ("hf-bf16", "mapped"),
                                           ("gguf", "mapped"), ("gguf", "dense"), ("q8_0", "mapped")])
def test_logits_and_greedy_tokens_are_transformers(checkpoints, name, weights):
    """Prefill and each decode step within 1e-5 of transformers' logits (float32), and its 32 greedy tokens."""
    path, reference = checkpoints[name]
    model = pagelm.load(path, weights=weights, dtype="float32")
    assert model.loader.architecture == "qwen35moe"
    tokens, logits = greedy(model, PROMPT)
    check_greedy(reference, PROMPT, tokens, logits, F32_REL_TOL)
    with torch.inference_mode():
        ref = reference(torch.tensor([PROMPT])).logits[0].numpy()
    session = model.session(len(PROMPT))
    rows = [session.prefill(PROMPT[:3])] + [session.decode(t) for t in PROMPT[3:]]
    assert max(rel(row, r) for row, r in zip(rows, ref[2:])) <= F32_REL_TOL


@pytest.mark.parametrize("name", ["hf", "gguf", "q8_0"])
def test_every_token_is_routed_as_transformers_routes_it(checkpoints, name):
    """The prefill's tokens and each decoded one go to transformers' top-k experts, in its order."""
    path, reference = checkpoints[name]
    check_routes(pagelm.load(path, dtype="float32"), reference, PROMPT, layers=TINY.layers)



@pytest.mark.parametrize("name, weights", [("gguf", "mapped"), ("gguf", "dense"), ("q8_0", "mapped-int8")])
def test_sequences_sharing_and_parting_experts_decode_their_own_bits(checkpoints, name, weights):
    check_sharing_and_parting(pagelm.load(checkpoints[name][0], weights=weights, dtype="float32"), PROMPT)


def test_experts_gate_and_up_in_one_tensor_are_the_same_model(checkpoints, tmp_path):
    """A file whose experts' gate and up rows are one ffn_gate_up_exps (newer llama.cpp's) computes the
    bits of the one that holds them apart, in place (each expert's rows a run of the fused tensor's), and
    its Hugging Face twin holds the same tensors."""
    path = str(tmp_path / "fused.gguf")
    hf_to_gguf(checkpoints["q8_0"][1], path, matrix_type=GGMLType.Q8_0, fused_gate_up=True)
    fused, apart = (pagelm.load(p, dtype="float32") for p in (path, checkpoints["q8_0"][0]))
    assert "blk.0.ffn_gate_up_exps.weight" in fused.loader.file.tensors
    a, b = fused.session(32), apart.session(32)
    assert same_bits(a.prefill(PROMPT), b.prefill(PROMPT))
    for token in (5, 50, 150):
        assert same_bits(a.decode(token), b.decode(token))
    from safetensors.numpy import load_file  # their Hugging Face twins: the same tensors

    twins = []
    for gguf_path, name in ((path, "fused-hf"), (checkpoints["q8_0"][0], "apart-hf")):
        write_directory(gguf_path, str(tmp_path / name), "hf", quantized="f32")
        twins.append(load_file(str(tmp_path / name / "model.safetensors")))
    assert twins[0].keys() == twins[1].keys() and "model.layers.0.mlp.experts.7.up_proj.weight" in twins[0]
    assert all(np.array_equal(twins[0][k], twins[1][k]) for k in twins[0])


def test_a_restored_checkpoint_and_the_prefix_cache_are_recomputing(checkpoints):
    """A session brought back from a detour, and one the prefix cache restores a prompt into, decode
    the bits of a session that computed the prompt itself."""
    check_restores(pagelm.load(checkpoints["gguf"][0], dtype="float32"), PROMPT, [1, 2, 3, 4, 5])


def test_the_experts_are_read_in_place(checkpoints):
    """In mapped mode each expert's operator reads its rows where the file map holds them, the shared
    expert's too; the router and the shared expert's gate are one operator; the weights' anonymous
    memory holds no expert, dense mode all of them."""
    path = checkpoints["q8_0"][0]
    model = pagelm.load(path, dtype="float32")
    file = model.loader.file
    mlp = model.network.layers[0].mlp
    info = file.tensors["blk.0.ffn_down_exps.weight"]
    buffer = file.tensor_buffer("blk.0.ffn_down_exps.weight")[0]
    per_expert = info.nbytes // info.shape[0]
    for e, op in enumerate(mlp.down):
        assert isinstance(op, MappedLinear)
        (part,) = op.parts
        assert part.data.ctypes.data == buffer.ctypes.data + info.offset + e * per_expert
    gate_up, down = mlp.shared
    assert isinstance(gate_up, MappedLinear) and isinstance(down, MappedLinear)
    assert mlp.router.out_features == TINY.experts[0] + 1
    expert_bytes = sum(t.nbytes for name, t in file.tensors.items() if "_exps." in name)
    assert model.loader.nbytes < expert_bytes / 4
    assert pagelm.load(path, weights="dense", dtype="float32").loader.nbytes > expert_bytes


def test_the_ggufs_hugging_face_twin_is_read_by_transformers_the_same_way(checkpoints, tmp_path):
    """pagelm's GGUF → Hugging Face writer splits each 3-D expert tensor into transformers' per-expert
    tensors, writes the shared expert and its gate and the experts' config keys."""
    import transformers

    path, reference = checkpoints["gguf"]
    twin = str(tmp_path / "twin")
    write_directory(path, twin, "hf", quantized="f32")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Qwen3_5MoeForCausalLM"
    assert (loaded.config.num_experts, loaded.config.shared_expert_intermediate_size) == (8, 64)
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0].numpy()
        assert rel(loaded(torch.tensor([PROMPT])).logits[0].numpy(), want) <= F32_REL_TOL
    assert rel(pagelm.load(twin, dtype="float32").session(32).prefill(PROMPT), want[-1]) <= F32_REL_TOL


def test_the_synthetic_shapes_run(tmp_path):
    """`pagelm synth --shape qwen3.5-35b-a3b-tiny` (Q8_0, and the Q4_K_M mix) loads and decodes peaked logits."""
    for mix in (None, "q4_k_m"):
        path = str(tmp_path / f"{mix}.gguf")
        plan = {t.name: t for t in write_model(path, SHAPES["qwen3.5-35b-a3b-tiny"], seed=3, mix=mix)}
        assert plan["blk.0.ffn_gate_inp_shexp.weight"].dims == (128,)
        model = pagelm.load(path, dtype="float32")
        session = model.session(16)
        session.prefill([5, 6, 7, 8])
        logits = session.decode(9)
        top2 = np.sort(logits)[-2:]
        assert np.isfinite(logits).all() and top2[1] - top2[0] > 0.5


@pytest.mark.parametrize("key, value, words", [
    ("num_experts", 6, r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \(8, 32, 64\).*expected \(6, 32, 64\)"),
    ("num_experts_per_tok", 9, r"expert_used_count 9 exceeds expert_count 8"),
    ("shared_expert_intermediate_size", 32,
     r"tensor 'blk\.0\.ffn_gate_shexp\.weight' has shape \(64, 64\).*expected \(32, 64\)"),
    ("shared_expert_intermediate_size", None, r"qwen35moe\.expert_shared_feed_forward_length"),
])
def test_expert_counts_unlike_the_file_are_named(checkpoints, tmp_path, key, value, words):
    """A GGUF whose metadata says other expert counts than its tensors hold (or leaves one out)."""
    model = copy.deepcopy(checkpoints["gguf"][1])
    drop = ()
    if value is None:
        drop = ("qwen35moe.expert_shared_feed_forward_length",)
    else:
        setattr(model.config, key, value)  # the metadata says so; the tensors hold what they hold
    path = str(tmp_path / "bad.gguf")
    hf_to_gguf(model, path, drop_keys=drop)
    with pytest.raises(ModelFormatError, match=words):
        pagelm.load(path)


@pytest.mark.parametrize("change, words", [
    ({"num_experts": 6}, r"tensor 'blk\.0\.ffn_gate_inp\.weight' has shape \(8, 64\).*expected \(6, 64\)"),
    ({"shared_expert_intermediate_size": "wide"}, "key 'shared_expert_intermediate_size' is \"wide\""),
])
def test_a_directory_that_disagrees_with_itself_is_refused_by_name(checkpoints, tmp_path, change, words):
    with pytest.raises(PagelmError, match=words):
        pagelm.load(str(changed_directory(checkpoints["hf"][0], tmp_path, change)))


def test_the_real_config_is_llama_cpps_metadata_and_the_synthetic_shapes():
    """Qwen3.5-35B-A3B's config.json (huggingface.co/Qwen/Qwen3.5-35B-A3B: the multimodal model's text_config)
    read as the GGUF keys llama.cpp's converter writes for it, which are the synthetic qwen3.5-35b-a3b's."""
    from pagelm.models.qwen35 import hf_layout
    from pagelm.tools.synth import model_metadata
    from pagelm.weights.hf import HFConfig

    text = {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "vocab_size": 248_320, "max_position_embeddings": 262_144, "mlp_only_layers": [],
            "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(40)],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "text_config": text}
    layout = hf_layout(HFConfig(config, "config.json"), None)
    a = "qwen35moe."
    want = {"general.architecture": "qwen35moe", a + "block_count": 40, a + "embedding_length": 2048,
            a + "attention.head_count": 16, a + "attention.head_count_kv": 2, a + "attention.key_length": 256,
            a + "rope.dimension_count": 64, a + "rope.freq_base": 1e7, a + "rope.dimension_sections": [11, 11, 10, 0],
            a + "full_attention_interval": 4, a + "ssm.conv_kernel": 4, a + "ssm.inner_size": 4096,
            a + "ssm.state_size": 128, a + "ssm.group_count": 16, a + "ssm.time_step_rank": 32,
            a + "expert_count": 256, a + "expert_used_count": 8, a + "expert_feed_forward_length": 512,
            a + "expert_shared_feed_forward_length": 512, a + "attention.layer_norm_rms_epsilon": 1e-6}
    assert {k: layout.metadata.get(k) for k in want} == want
    assert a + "feed_forward_length" not in layout.metadata
    synthetic = {k: v if isinstance(v, str) else v.value for k, v in model_metadata(SHAPES["qwen3.5-35b-a3b"]).items()
                 if k in want}
    synthetic[a + "rope.dimension_sections"] = synthetic[a + "rope.dimension_sections"][1]
    eps = a + "attention.layer_norm_rms_epsilon"
    assert synthetic.pop(eps) == pytest.approx(want[eps]) and synthetic == {k: v for k, v in want.items() if k != eps}
    hf = {name: tmap.hf for name, tmap in layout.tensors.items() if name.startswith("blk.3.ffn")}
    assert hf["blk.3.ffn_gate_inp.weight"] == "model.layers.3.mlp.gate.weight"
    assert hf["blk.3.ffn_down_exps.weight.255"] == "model.layers.3.mlp.experts.255.down_proj.weight"
    assert hf["blk.3.ffn_gate_inp_shexp.weight"] == "model.layers.3.mlp.shared_expert_gate.weight"
    assert hf["blk.3.ffn_up_shexp.weight"] == "model.layers.3.mlp.shared_expert.up_proj.weight"
    assert len(hf) == 3 * 256 + 5
