"""gpt-oss against transformers' own tiny random GptOssForCausalLM (a sliding window of 4 under a
10-token prompt, YaRN rope, attention sinks, biases everywhere): its save_pretrained directories
(float32, bf16) read in place, and GGUF files written the way llama.cpp's converter writes them
(F32; Q8_0; MXFP4 experts) against transformers on the values each holds: prefill and decode logits,
32 greedy tokens, every token routed to transformers' experts; a batched decode whose sequences share
experts and part ways is each one's own bits; checkpoints and the prefix cache are recomputing; the
directory's transposed experts stay in its map; what pagelm cannot read is refused by name; pagelm's
synthetic gpt-oss-20b-tiny matches transformers on its values, and its verify passes are one-token decodes."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch

import pagelm
from pagelm.errors import PagelmError
from pagelm.quant import int8dot
from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant.types import GGMLType
from pagelm.weights.linear import TransposedLinear

from moe_checks import changed_directory, check_restores, check_routes, check_sharing_and_parting
from hf_oracle import F32_REL_TOL, PROMPT, check_greedy, greedy, rel
from rows_check import verify_and_rewind, verify_together

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

WINDOW = 4  # under PROMPT's 10 tokens: the sliding layers see only part of it


def tiny_gpt_oss():
    """A random fp32 GptOssForCausalLM: 3 layers (sliding, full, sliding), 8 experts of which 2 per
    token, random biases and sinks (transformers zeroes the experts' biases), and gate/up biases large
    enough that the SwiGLU's clamps cut."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
        initializer_range=0.2, tie_word_embeddings=False)
    config._experts_implementation = "eager"  # the reference loop of GptOssExperts.forward
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.add_(torch.randn(p.shape) * 0.5)
        for w in model.model.layers:  # gate and up values beyond the clamp's ±7
            w.mlp.experts.gate_up_proj_bias.mul_(16)
    return model


def _metadata(config) -> dict:
    """The GGUF keys llama.cpp's converter writes for a GptOssConfig (TextModel's and GptOssModel's)."""
    arch = "gpt-oss"
    u32 = lambda x: Typed(GGUFValueType.UINT32, int(x))  # noqa: E731
    f32 = lambda x: Typed(GGUFValueType.FLOAT32, float(x))  # noqa: E731
    k, a, r = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
    rope = config.rope_parameters
    return {
        gguf.Keys.General.ARCHITECTURE: arch, "tokenizer.ggml.model": "none",
        k.CONTEXT_LENGTH.format(arch=arch): u32(config.max_position_embeddings),
        k.EMBEDDING_LENGTH.format(arch=arch): u32(config.hidden_size),
        k.FEED_FORWARD_LENGTH.format(arch=arch): u32(config.intermediate_size),
        k.BLOCK_COUNT.format(arch=arch): u32(config.num_hidden_layers),
        a.HEAD_COUNT.format(arch=arch): u32(config.num_attention_heads),
        a.HEAD_COUNT_KV.format(arch=arch): u32(config.num_key_value_heads),
        a.KEY_LENGTH.format(arch=arch): u32(config.head_dim), a.VALUE_LENGTH.format(arch=arch): u32(config.head_dim),
        a.LAYERNORM_RMS_EPS.format(arch=arch): f32(config.rms_norm_eps),
        a.SLIDING_WINDOW.format(arch=arch): u32(config.sliding_window),
        r.FREQ_BASE.format(arch=arch): f32(rope["rope_theta"]),
        r.SCALING_TYPE.format(arch=arch): "yarn", r.SCALING_FACTOR.format(arch=arch): f32(rope["factor"]),
        r.SCALING_ORIG_CTX_LEN.format(arch=arch): u32(rope["original_max_position_embeddings"]),
        k.EXPERT_COUNT.format(arch=arch): u32(config.num_local_experts),
        k.EXPERT_USED_COUNT.format(arch=arch): u32(config.num_experts_per_tok),
        k.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch): u32(config.intermediate_size),
    }


def write_gpt_oss_gguf(model, path: str, matrix_type: GGMLType, expert_type: GGMLType) -> dict[str, torch.Tensor]:
    """`model` as llama.cpp's GptOssModel converter writes it (names from gguf-py's map): gate_up_proj
    (experts, hidden, 2·ffn) split into its even (gate) and odd (up) columns, each transposed to
    (experts, ffn, hidden), likewise its bias; down_proj transposed; sinks as attn_sinks.weight; the
    2-D matrices in `matrix_type`, the experts in `expert_type` (encoded by gguf.quants), the router
    and every vector F32. Returns the state dict the file holds (each tensor's decoded values)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, model.config.num_hidden_layers)
    tensors = []

    def add(hf_name: str, values: np.ndarray, qtype: GGMLType) -> np.ndarray:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) + (".weight" if hf_name.endswith("sinks") else "")
        data = values = np.ascontiguousarray(values, np.float32)
        if qtype != GGMLType.F32:
            data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype.name])
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype.name])
        tensors.append(TensorToWrite(name, tuple(reversed(values.shape)), qtype, [np.ascontiguousarray(data)]))
        return values

    held = {}
    for hf_name, t in model.state_dict().items():
        v = t.detach().float().numpy()
        base = hf_name.rsplit(".", 1)[0] + "."
        if hf_name.endswith("experts.gate_up_proj"):
            w = v.transpose(0, 2, 1)  # (experts, 2·ffn, hidden)
            both = np.empty_like(w)
            both[:, ::2] = add(base + "gate_proj.weight", w[:, ::2], expert_type)
            both[:, 1::2] = add(base + "up_proj.weight", w[:, 1::2], expert_type)
            v = both.transpose(0, 2, 1)
        elif hf_name.endswith("experts.gate_up_proj_bias"):
            add(base + "gate_proj.bias", v[:, ::2], GGMLType.F32)
            add(base + "up_proj.bias", v[:, 1::2], GGMLType.F32)
        elif hf_name.endswith("experts.down_proj"):
            v = add(base + "down_proj.weight", v.transpose(0, 2, 1), expert_type).transpose(0, 2, 1)
        elif hf_name.endswith("experts.down_proj_bias"):
            add(base + "down_proj.bias", v, GGMLType.F32)
        else:
            v = add(hf_name, v, matrix_type if v.ndim == 2 and "router" not in hf_name else GGMLType.F32)
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(v, np.float32))
    write_gguf(path, _metadata(model.config), tensors)
    return held


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, transformers float32 model computing what it holds)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    model = tiny_gpt_oss()
    model.save_pretrained(root / "hf")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(root / "hf-bf16")
    bf16 = copy.deepcopy(model)  # float32, with the bf16 values
    bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in bf16.state_dict().items()})
    out = {"hf": (str(root / "hf"), model), "hf-bf16": (str(root / "hf-bf16"), bf16)}
    for name, matrices, experts in (("f32", GGMLType.F32, GGMLType.F32), ("q8_0", GGMLType.Q8_0, GGMLType.Q8_0),
                                    ("mxfp4", GGMLType.F32, GGMLType.MXFP4)):
        path = str(root / f"{name}.gguf")
        reference = copy.deepcopy(model)
        reference.load_state_dict(write_gpt_oss_gguf(model, path, matrices, experts))
        out[name] = (path, reference)
    return out


@pytest.mark.parametrize("name, weights", [("hf", "mapped"), ("hf", "dense"), ("hf-bf16", "mapped"),
                                           ("f32", "mapped"), ("f32", "dense"), ("q8_0", "mapped"),
                                           ("mxfp4", "mapped"), ("mxfp4", "dense")])
def test_logits_and_greedy_tokens_match_transformers(checkpoints, name, weights):
    path, reference = checkpoints[name]
    model = pagelm.load(path, weights=weights, dtype="float32")
    tokens, logits = greedy(model, PROMPT)
    check_greedy(reference, PROMPT, tokens, logits, F32_REL_TOL)
    with torch.inference_mode():  # the prefill's every row, not only its last
        ref = reference(torch.tensor([PROMPT])).logits[0].numpy()
    session = model.session(len(PROMPT))
    rows = [session.prefill(PROMPT[:3])] + [session.decode(t) for t in PROMPT[3:]]
    assert max(rel(row, r) for row, r in zip(rows, ref[2:])) <= F32_REL_TOL




@pytest.mark.parametrize("name", ["hf", "mxfp4"])
def test_every_token_is_routed_as_transformers_routes_it(checkpoints, name):
    """The prefill's tokens and each decoded one go to the top k of transformers' router logits
    (with their bias), in its order."""
    path, reference = checkpoints[name]
    check_routes(pagelm.load(path, dtype="float32"), reference, PROMPT, softmax_first=False)



@pytest.mark.parametrize("name, weights", [("mxfp4", "mapped"), ("f32", "dense"), ("hf", "mapped")])
def test_sequences_sharing_and_parting_experts_decode_their_own_bits(checkpoints, name, weights):
    """Sequences on both sides of the window, in one batch, each decode their bits alone."""
    check_sharing_and_parting(pagelm.load(checkpoints[name][0], weights=weights, dtype="float32"), PROMPT)


def test_a_restored_checkpoint_and_the_prefix_cache_are_recomputing(checkpoints):
    """A session brought back from a detour past the window, and one the prefix cache restores a
    prompt into, decode the bits of a session that computed the prompt itself."""
    check_restores(pagelm.load(checkpoints["mxfp4"][0], dtype="float32"), PROMPT, [1, 2, 3, 4, 5, 6, 7], (9, 99, 199, 3, 4, 5))


def test_the_directorys_experts_are_read_in_place(checkpoints):
    """In mapped mode each expert of a save_pretrained directory multiplies its slice of the shard's
    map (no copy); the weights' anonymous memory holds no expert."""
    path = checkpoints["hf"][0]
    model = pagelm.load(path, dtype="float32")
    file = model.loader.file
    data, _ = file.tensor_buffer("blk.0.ffn_gate_exps.weight")
    lo, hi = data.ctypes.data, data.ctypes.data + data.nbytes
    for w in model.network.layers:
        for op in (*w.experts.gate_up, *w.experts.down):
            assert isinstance(op, TransposedLinear) and lo <= op.stored.data_ptr() < hi
    expert_bytes = sum(info.nbytes for name, info in file.tensors.items() if name.endswith("up_exps.weight")
                       or name.endswith("down_exps.weight"))
    assert model.loader.nbytes < expert_bytes / 2
    assert pagelm.load(path, weights="dense", dtype="float32").loader.nbytes > expert_bytes


def _changed(checkpoints, tmp_path, change: dict, tensors: dict | None = None) -> str:
    directory = changed_directory(checkpoints["hf"][0], tmp_path, change)
    if tensors:
        from safetensors.torch import load_file, save_file

        held = load_file(str(directory / "model.safetensors"))
        save_file({**held, **tensors}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


@pytest.mark.parametrize("change, tensors, words", [
    ({}, {"model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(8, 64, 1, 16, dtype=torch.uint8)},
     r"tensor 'model\.layers\.0\.mlp\.experts\.down_proj_blocks' holds MXFP4-packed experts"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, None,
     "layer_types must repeat a run of layers ending in one full_attention layer"),
    ({"swiglu_limit": 5.0}, None, "swiglu_limit 5.0 is not supported for gpt-oss"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                          "rope_theta": 150000.0, "mscale": 2.0}}, None, "rope setting 'mscale' is not supported"),
])
def test_a_directory_pagelm_cannot_read_as_it_says_is_refused_by_name(checkpoints, tmp_path, change, tensors, words):
    with pytest.raises(PagelmError, match=words):
        pagelm.load(_changed(checkpoints, tmp_path, change, tensors))


def _transformers_of_gguf(path: str, shape):
    """A transformers GptOssForCausalLM holding a synthetic gpt-oss GGUF's values as gguf-py decodes them
    (llama.cpp's converter undone: gate and up interleaved again into gate_up_proj, transposed)."""
    import transformers

    values = {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
              for t in gguf.GGUFReader(path).tensors}
    config = transformers.GptOssConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.expert_ffn,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_head, num_key_value_heads=shape.n_head_kv,
        head_dim=shape.head_dim, num_local_experts=shape.n_experts, num_experts_per_tok=shape.n_experts_used,
        sliding_window=shape.sliding_window, rms_norm_eps=shape.rms_eps, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": shape.rope_theta, "factor": shape.yarn_rope[0],
                         "original_max_position_embeddings": shape.yarn_rope[1], "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False})
    config._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    held = {"model.embed_tokens.weight": values["token_embd.weight"], "lm_head.weight": values["output.weight"],
            "model.norm.weight": values["output_norm.weight"]}
    names = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
             "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
             "ffn_gate_inp.bias": "mlp.router.bias", "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
             **{f"attn_{x}.{kind}": f"self_attn.{y}_proj.{kind}" for x, y in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                              ("output", "o")) for kind in ("weight", "bias")}}
    for i in range(shape.n_layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        held.update({p + hf: values[b + name] for name, hf in names.items()})
        gate, up = values[b + "ffn_gate_exps.weight"], values[b + "ffn_up_exps.weight"]  # (experts, ffn, hidden)
        both = np.stack([gate, up], 2).reshape(gate.shape[0], -1, gate.shape[2])  # rows gate0, up0, gate1, ...
        held[p + "mlp.experts.gate_up_proj"] = both.transpose(0, 2, 1)
        held[p + "mlp.experts.gate_up_proj_bias"] = np.stack([values[b + "ffn_gate_exps.bias"],
                                                              values[b + "ffn_up_exps.bias"]], 2).reshape(gate.shape[0], -1)
        held[p + "mlp.experts.down_proj"] = values[b + "ffn_down_exps.weight"].transpose(0, 2, 1)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()})
    return model


def test_the_synthetic_tiny_file_matches_transformers_on_its_values(tmp_path):
    """`pagelm synth --shape gpt-oss-20b-tiny` (MXFP4 experts from pagelm's own encoder, Q8_0 matrices)
    in both weights modes against transformers on the values gguf-py decodes from it."""
    from pagelm.tools.synth import SHAPES, write_model

    shape = SHAPES["gpt-oss-20b-tiny"]
    path = str(tmp_path / "tiny.gguf")
    plan = {t.name: t.ggml_type for t in write_model(path, shape, seed=3)}
    assert plan["blk.0.ffn_down_exps.weight"] == GGMLType.MXFP4 and plan["blk.0.attn_q.weight"] == GGMLType.Q8_0
    reference = _transformers_of_gguf(path, shape)
    prompt = PROMPT + [300, 4000, 17]  # longer than the window of 8
    for weights in ("mapped", "dense"):
        tokens, logits = greedy(pagelm.load(path, weights=weights, dtype="float32"), prompt, steps=8)
        check_greedy(reference, prompt, tokens, logits, F32_REL_TOL)


@pytest.mark.parametrize("weights, dtype", [("mapped", "float32"), ("dense", "bfloat16"), ("mapped-int8", "bfloat16")])
def test_verify_pass_rows_and_rewinds_are_one_token_decodes(gpt_oss_tiny_gguf, weights, dtype):
    """Speculative decoding's verify pass over the synthetic gpt-oss-20b-tiny (tests/conftest.py),
    past its window of 8: each row is a one-token decode's bits, and rewinds are exact."""
    if weights == "mapped-int8" and not int8dot.available():
        pytest.skip("mapped-int8 needs AVX2")
    model = pagelm.load(gpt_oss_tiny_gguf, weights=weights, dtype=dtype)
    verify_and_rewind(model)
    verify_together(model)


def test_the_ggufs_hugging_face_twin_is_read_by_transformers_the_same_way(checkpoints, tmp_path):
    """pagelm's GGUF → Hugging Face writer interleaves ffn_gate_exps and ffn_up_exps back into the
    transposed gate_up_proj (and their biases into gate_up_proj_bias) and writes gpt_oss's config."""
    import transformers

    from pagelm.tools.convert import write_directory

    path, reference = checkpoints["mxfp4"]
    twin = str(tmp_path / "twin")
    write_directory(path, twin, "hf", quantized="f32")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    assert loaded.config.sliding_window == WINDOW and loaded.config.layer_types[:2] == ["sliding_attention",
                                                                                         "full_attention"]
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0].numpy()
        assert rel(loaded(torch.tensor([PROMPT])).logits[0].numpy(), want) <= F32_REL_TOL
    assert rel(pagelm.load(twin, dtype="float32").session(32).prefill(PROMPT), want[-1]) <= F32_REL_TOL
