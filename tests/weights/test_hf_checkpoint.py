"""Hugging Face checkpoint directories: transformers' own `save_pretrained` of tiny random models
(float32 and bf16) against transformers' logits and greedy tokens, the real SmolLM2 and Gemma 3
against their Hugging Face twins (`weights.hf_writer`), and directories that are wrong."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from pagelm.chat.model import ChatModel
from pagelm.engine.load import load_model
from pagelm.errors import ModelFormatError, PagelmError, UnsupportedError
from pagelm.formats.safetensors import SafetensorsFile, TensorToWrite, write_safetensors
from pagelm.weights import linear
from pagelm.tools.convert import write_directory

from hf_oracle import F32_REL_TOL, PROMPT, REL_TOL, STEPS, check_greedy, greedy, perturb_constant_init, rel

transformers = pytest.importorskip("transformers")

LOOSE_F32 = ("qwen35",)  # its chunked delta rule sums in another order than transformers' (1.3e-5)


def _configs():
    t = transformers
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, initializer_range=0.2)
    return {
        # value heads outnumber key heads: GGUF's tiled order is exercised
        "qwen35": t.Qwen3_5TextConfig(**common, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                      linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True),
        "llama": t.LlamaConfig(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               tie_word_embeddings=False),
        # Llama 3.2: rope scaled as Llama 3.1 scales it (every kind of pair: kept, blended, divided), a tied head
        "llama3": t.LlamaConfig(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                tie_word_embeddings=True, rope_parameters={
                                    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
        # q/k/v biases, unpermuted q/k rows, a tied head
        "qwen2": t.Qwen2Config(**common, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               tie_word_embeddings=True),
        # q/k norms, a head dim other than hidden / heads, an untied head
        "qwen3": t.Qwen3Config(**common, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                               head_dim=32, tie_word_embeddings=False),
        # six layers with a short window: a global layer, and sliding ones that slide
        "gemma3": t.Gemma3TextConfig(**common, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                                     head_dim=32, sliding_window=8, query_pre_attn_scalar=32),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(architecture, dtype) -> a directory written by transformers' save_pretrained."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for arch, config in _configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        perturb_constant_init(model)
        for dtype in (torch.float32, torch.bfloat16):
            path = root / f"{arch}-{str(dtype).split('.')[-1]}"
            model.to(dtype).save_pretrained(path)
            out[arch, dtype] = str(path)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen35", "llama", "llama3", "qwen2", "qwen3", "gemma3"])
def test_transformers_checkpoints_match_transformers(saved, arch, dtype):
    path = saved[arch, dtype]
    # the reference computes in float32 from the stored values (bf16 ones are exact in float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path, dtype="float32")
    assert model.config.vocab == 256
    tokens, logits = greedy(model, PROMPT, STEPS)
    tol = F32_REL_TOL if dtype == torch.float32 and arch not in LOOSE_F32 else REL_TOL
    check_greedy(reference, PROMPT, tokens, logits, tol)


def test_both_weights_modes_agree_and_bf16_prefill_is_bit_identical(saved):
    path = saved["qwen35", torch.bfloat16]
    mapped, dense = load_model(path, weights="mapped"), load_model(path, weights="dense")
    prompt = PROMPT * 4  # many rows: the GEMM path, the same calls in both modes
    assert np.array_equal(mapped.session(64).prefill(prompt), dense.session(64).prefill(prompt))
    scratch = mapped.loader.scratch.nbytes  # the largest prefill tile, bf16 and widened to float32 for the GEMM
    assert 0 < scratch <= 6 * linear.TILE_VALUES
    assert mapped.weights_nbytes - scratch < dense.weights_nbytes / 4  # the matrices stay in the file


@pytest.fixture(scope="module", params=["smollm2_gguf", "gemma3_gguf"])
def twin(request, tmp_path_factory):
    """A real GGUF and its Hugging Face twin (quantized matrices as their exact float32 values)."""
    gguf = request.getfixturevalue(request.param)
    out = str(tmp_path_factory.mktemp("twin") / request.param.removesuffix("_gguf"))
    write_directory(gguf, out, "hf", quantized="f32")
    return gguf, out


def test_real_models_and_their_hf_twins_agree(twin):
    gguf, directory = twin
    a, b = load_model(gguf, dtype="float32"), load_model(directory, dtype="float32")
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 5000, 12)]
    tokens_a, logits_a = greedy(a, prompt, STEPS)
    tokens_b, logits_b = greedy(b, prompt, STEPS)
    assert max(rel(x, y) for x, y in zip(logits_b, logits_a)) <= REL_TOL
    assert tokens_a == tokens_b


def test_the_twin_is_a_checkpoint_transformers_reads_the_same_way(twin):
    """The writer checked by transformers itself: its logits on the twin are pagelm's."""
    _, directory = twin
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = reference(torch.tensor([PROMPT])).logits[0, -1].numpy()
    assert rel(load_model(directory, dtype="float32").session(32).prefill(PROMPT), ref) <= REL_TOL


def test_chat_through_the_twin_answers_as_the_gguf_does(twin):
    gguf, directory = twin
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answers = []
    for path in (gguf, directory):
        chat = ChatModel.open(path, dtype="float32")
        prompt = chat.chat_prompt(messages, None)
        answers.append((prompt.tokens, chat.tokenizer.eos_ids))
    assert answers[0] == answers[1]


# ------------------------------------------------------------------------------ bad directories


@pytest.fixture
def broken(saved, tmp_path):
    """A writable copy of the float32 llama checkpoint."""
    path = tmp_path / "llama"
    shutil.copytree(saved["llama", torch.float32], path)
    return path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, error, words", [
    ({"hidden_size": None}, ModelFormatError, ["config.json", "'hidden_size' missing"]),
    ({"hidden_size": "64"}, ModelFormatError, ["config.json", "'hidden_size'", "integer"]),
    ({"hidden_size": 48}, ModelFormatError, ["token_embd.weight", "48"]),
    ({"num_hidden_layers": 3}, ModelFormatError, ["num_hidden_layers is 3", "layers 0..1"]),
    ({"num_hidden_layers": 10**15}, ModelFormatError, ["num_hidden_layers"]),
    ({"model_type": "mamba"}, UnsupportedError, ["model_type \"mamba\"", "llama"]),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, UnsupportedError, ["yarn"]),
])
def test_config_errors_name_the_file_and_the_problem(broken, changes, error, words):
    _edit_config(broken, **changes)
    with pytest.raises(error) as e:
        load_model(str(broken))
    for word in words:
        assert word in str(e.value)


def test_directory_errors(broken, tmp_path):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="config.json is not valid JSON"):
        load_model(str(broken))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFormatError, match="without config.json"):
        load_model(str(empty))


def test_missing_tensor_and_shards(saved, tmp_path):
    source = saved["llama", torch.float32]
    path = tmp_path / "sharded"
    path.mkdir()
    shutil.copy(os.path.join(source, "config.json"), path)
    with SafetensorsFile.open(os.path.join(source, "model.safetensors")) as f:
        names = sorted(f.tensors)
        tensors = {n: np.array(f.tensor(n)) for n in names if n != "model.layers.1.mlp.up_proj.weight"}
    half = len(tensors) // 2
    shards = {"a.safetensors": dict(list(tensors.items())[:half]), "b.safetensors": dict(list(tensors.items())[half:])}
    for shard, part in shards.items():
        write_safetensors(str(path / shard), [TensorToWrite(n, "F32", v.shape, lambda v=v: v) for n, v in part.items()])
    index = {"weight_map": {n: shard for shard, part in shards.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="blk.1.ffn_up.weight"):
        load_model(str(path))
    index["weight_map"]["model.layers.1.mlp.up_proj.weight"] = "c.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="shard 'c.safetensors' is missing"):
        load_model(str(path))


def test_a_matrix_of_an_integer_dtype_is_refused(saved, tmp_path):
    source = saved["llama", torch.float32]
    path = tmp_path / "int"
    shutil.copytree(source, path)
    with SafetensorsFile.open(os.path.join(source, "model.safetensors")) as f:
        tensors = [TensorToWrite(n, "F32", f.tensors[n].shape, lambda n=n, f=f: np.array(f.tensor(n))) for n in f.tensors]
        tensors[0] = TensorToWrite(tensors[0].name, "I32", tensors[0].shape,
                                   lambda: np.zeros(tensors[0].shape, np.int32))
        write_safetensors(str(path / "model.safetensors"), tensors)
    with pytest.raises(UnsupportedError, match="dtype I32"):
        load_model(str(path))


def test_chat_needs_a_tokenizer(saved):
    with pytest.raises(ModelFormatError, match="no tokenizer.json"):
        ChatModel.open(saved["llama", torch.float32])


def test_random_config_mutations_fail_cleanly(saved, tmp_path):
    """300 configs with a key deleted or set to a hostile value: each opens or fails with a
    PagelmError naming the problem; nothing else escapes, nothing hangs or allocates unbounded."""
    source = saved["qwen35", torch.float32]
    base = json.loads(open(os.path.join(source, "config.json")).read())
    path = tmp_path / "m"
    shutil.copytree(source, path)
    rng = np.random.default_rng(0)
    hostile = [None, -1, 0, 1, 3, 2**31, 2**63, 1e308, "x", [], {}, True, 0.5]
    keys = sorted(base)
    for _ in range(300):
        config = dict(base)
        for key in rng.choice(keys, rng.integers(1, 3), replace=False):
            value = hostile[rng.integers(len(hostile))]
            if value is None:
                config.pop(key)
            else:
                config[key] = value
        (path / "config.json").write_text(json.dumps(config))
        try:
            load_model(str(path), dtype="float32")
        except PagelmError as e:
            assert str(e)
