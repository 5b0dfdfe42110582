"""pagelm's lfm2 against transformers' Lfm2ForCausalLM on a tiny random model: its save_pretrained
directory (float32, bf16), llama.cpp's GGUF form (F32, Q8_0 against the weights gguf.quants
dequantizes), the GGUF's Hugging Face twin; batched decode, checkpoints, the prefix cache and the
state's bytes with the conv windows in them."""

from __future__ import annotations

import json
import mmap
import shutil

import gguf.quants
import numpy as np
import pytest
import torch

import pagelm
from pagelm.engine.batch import MAX_BATCH
from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.quant import int8dot
from pagelm.quant.types import GGMLType
from pagelm.serve.prefix_cache import PrefixCache
from pagelm.tools.convert import write_directory

transformers = pytest.importorskip("transformers")
from lfm2_hf import build_hf_model, hf_to_gguf  # noqa: E402 (needs transformers)
from rows_check import verify_and_rewind, verify_together  # noqa: E402

PROMPT = [3, 17, 101, 250, 7, 42, 199, 64, 5, 128, 9, 77]
STEPS = 32
FP32_TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py


@pytest.fixture(scope="module")
def hf():
    return build_hf_model()


@pytest.fixture(scope="module")
def files(hf, tmp_path_factory):
    """name -> path: the float32 and bf16 save_pretrained directories, the F32 and Q8_0 GGUFs (and
    the Q8_0 matrices' bytes)."""
    root = tmp_path_factory.mktemp("lfm2")
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        out[str(dtype)] = str(root / str(dtype))
        build_hf_model().to(dtype).save_pretrained(out[str(dtype)])
    for kind in (GGMLType.F32, GGMLType.Q8_0):
        out[kind.name] = str(root / f"lfm2-{kind.name}.gguf")
        out[kind.name + " bytes"] = hf_to_gguf(hf, out[kind.name], kind)
    return out


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _check_against(reference, model, tol: float) -> None:
    """pagelm's prefill and 32 greedy decode steps: each step's logits within `tol` of the
    reference's forward over the same tokens, and the tokens those of the reference's own cached
    greedy generation."""
    session = model.session(len(PROMPT) + STEPS)
    logits, steps = session.prefill(PROMPT), []
    for _ in range(STEPS):
        steps.append(logits)
        logits = session.decode(int(logits.argmax()))
    tokens = session.tokens[len(PROMPT):]
    with torch.inference_mode():
        ref = reference(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float().numpy()
        generated = reference.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False,
                                       pad_token_id=0)[0, len(PROMPT):].tolist()
    for step, (got, want) in enumerate(zip(steps, ref)):
        assert _rel(got, want) <= tol, f"step {step}: {_rel(got, want):.2e}"
    assert tokens == generated


@pytest.mark.parametrize("weights", ["mapped", "dense"])
def test_float32_directory_matches_transformers(hf, files, weights):
    _check_against(hf, pagelm.load(files[str(torch.float32)], weights=weights, dtype="float32"), FP32_TOL)


def test_bf16_directory_read_in_float32_matches_transformers_on_its_weights(files):
    reference = transformers.AutoModelForCausalLM.from_pretrained(files[str(torch.bfloat16)], dtype=torch.float32)
    _check_against(reference.eval(), pagelm.load(files[str(torch.bfloat16)], dtype="float32"), 1e-4)


def test_f32_gguf_matches_transformers(hf, files):
    _check_against(hf, pagelm.load(files["F32"], dtype="float32"), FP32_TOL)


def test_q8_0_gguf_matches_transformers_on_the_dequantized_weights(files):
    reference = build_hf_model()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            data = files["Q8_0 bytes"].get(name)
            if data is not None and data.dtype == np.uint8:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)))
    assert not torch.equal(reference.model.layers[0].conv.in_proj.weight, build_hf_model().model.layers[0].conv.in_proj.weight)
    _check_against(reference, pagelm.load(files["Q8_0"], dtype="float32"), FP32_TOL)


def test_the_ggufs_hugging_face_twin_is_read_by_transformers_the_same_way(hf, files, tmp_path):
    twin = str(tmp_path / "twin")
    write_directory(files["F32"], twin, "hf", quantized="f32")
    reference = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
        assert _rel(reference(torch.tensor([PROMPT])).logits[0, -1].numpy(), want) <= FP32_TOL
    assert _rel(pagelm.load(twin, dtype="float32").session(32).prefill(PROMPT), want) <= FP32_TOL


# (file, weights, dtype) of the decode tests: each weights mode, both dtypes
MODES = [("F32", "mapped", "bfloat16"), ("torch.float32", "dense", "float32"), ("Q8_0", "mapped", "float32"),
         ("Q8_0", "mapped-int8", "bfloat16")]


def _load(files, path, weights, dtype):
    if weights == "mapped-int8" and not int8dot.available():
        pytest.skip("mapped-int8 needs AVX2")
    return pagelm.load(files[path], weights=weights, dtype=dtype)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("path, weights, dtype", MODES)
def test_batched_decode_is_each_sessions_own_bits(files, path, weights, dtype):
    model = _load(files, path, weights, dtype)
    prompts = [PROMPT, PROMPT[:3], [200], PROMPT[::-1] * 2]
    batched, alone = ([model.session(64) for _ in prompts] for _ in range(2))
    for b, a, prompt in zip(batched, alone, prompts):
        b.prefill(prompt)
        a.prefill(prompt)
    joined = model.session(64)
    joined.restore(alone[3].checkpoint())  # a sequence restored from a checkpoint joins
    batched[3] = joined
    for order in ([0, 1, 2, 3], [3, 1], [2, 0, 3, 1]):
        tokens = [int(alone[i].logits.argmax()) for i in order]
        rows = model.decode_batch([batched[i] for i in order], tokens)
        for i, token, row in zip(order, tokens, rows):
            assert _same_bits(row, alone[i].decode(token)), f"sequence {i}"
            assert torch.equal(batched[i].state.conv[0], alone[i].state.conv[0])


def test_a_full_batch_of_many_heads_is_each_sessions_own_bits(tmp_path):
    """16 sequences of 8 query heads: 128 rows of q, more than one token's norm kernel takes."""
    path = str(tmp_path / "heads.gguf")
    hf_to_gguf(build_hf_model(heads=8), path)
    model = pagelm.load(path, dtype="float32")
    batched, alone = ([model.session(32) for _ in range(MAX_BATCH)] for _ in range(2))
    for i, (b, a) in enumerate(zip(batched, alone)):
        b.prefill(PROMPT[: 1 + i % 5] + [i])
        a.prefill(PROMPT[: 1 + i % 5] + [i])
    for _ in range(2):
        tokens = [int(a.logits.argmax()) for a in alone]
        rows = model.decode_batch(batched, tokens)
        assert all(_same_bits(row, a.decode(token)) for row, a, token in zip(rows, alone, tokens))


def test_checkpoint_detour_restore_is_recomputing(files):
    model = pagelm.load(files["F32"], dtype="bfloat16")
    session, fresh = model.session(64), model.session(64)
    session.prefill(PROMPT)
    checkpoint = session.checkpoint()
    session.prefill([1, 2, 3, 4, 5])  # a detour: the conv windows and the KV caches move on
    session.decode(6)
    session.restore(checkpoint)
    fresh.prefill(PROMPT)
    assert _same_bits(session.logits, fresh.logits)
    for token in (9, 99, 199):
        assert _same_bits(session.decode(token), fresh.decode(token))
    reset = model.session(64)
    reset.prefill([7, 7, 7])
    reset.reset()  # the conv windows are zeroed with the rest
    assert _same_bits(reset.prefill(PROMPT), model.session(64).prefill(PROMPT))


def test_the_prefix_cache_restores_the_conv_windows(files):
    model = pagelm.load(files["F32"], dtype="float32")
    source = model.session(64)
    source.prefill(PROMPT)
    cache = PrefixCache(slots=4, max_bytes=1 << 24)
    entry = cache.store(source, whole=True)
    target = model.session(64)
    target.prefill([11, 12, 13, 14])
    cache.restore(entry, target)
    assert all(torch.equal(a, b) for a, b in zip(target.state.fixed_tensors(), source.state.fixed_tensors()))
    assert _same_bits(target.decode(5), source.decode(5))


def test_state_bytes_count_the_kv_caches_and_the_conv_windows(hf, files):
    c = hf.config
    model = pagelm.load(files["F32"], dtype="bfloat16")
    session = model.session(max_len=40)
    head_dim = c.hidden_size // c.num_attention_heads
    attention = sum(t != "conv" for t in c.layer_types)
    kv = attention * 2 * c.num_key_value_heads * 40 * head_dim * 2  # bf16
    conv = (len(c.layer_types) - attention) * (c.conv_L_cache - 1) * c.hidden_size * 4  # fp32
    assert session.nbytes == session.state.nbytes == conv  # the KV caches hold no page before a position is written
    session.prefill(PROMPT)
    assert conv < session.state.nbytes <= conv + -(-kv // mmap.PAGESIZE) * mmap.PAGESIZE  # written pages, at most all
    assert session.checkpoint().nbytes == attention * 2 * c.num_key_value_heads * len(PROMPT) * head_dim * 2 \
        + conv + c.vocab_size * 4


def test_a_missing_key_is_named(hf, tmp_path):
    path = tmp_path / "bad.gguf"
    hf_to_gguf(hf, path, drop_keys=("lfm2.shortconv.l_cache",))
    with pytest.raises(ModelFormatError, match="lfm2.shortconv.l_cache"):
        pagelm.load(str(path))


@pytest.mark.parametrize("changes, error, words", [
    ({"conv_bias": True}, UnsupportedError, "conv_bias true is not supported"),
    ({"layer_types": ["conv", "full_attention"]}, ModelFormatError, "layer_types lists 2 layers, expected 6"),
    ({"block_auto_adjust_ff_dim": "yes"}, ModelFormatError, "'block_auto_adjust_ff_dim' is \"yes\", expected a boolean"),
])
def test_config_errors_name_the_key(files, tmp_path, changes, error, words):
    path = tmp_path / "edited"
    shutil.copytree(files[str(torch.float32)], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(error) as e:
        pagelm.load(str(path))
    assert words in str(e.value)


@pytest.mark.parametrize("path, weights, dtype", MODES)
def test_verify_pass_rows_and_rewinds_are_one_token_decodes(files, path, weights, dtype):
    """Speculative decoding's pass over several tokens, its conv windows stepped and kept row by row."""
    model = _load(files, path, weights, dtype)
    verify_and_rewind(model)
    verify_together(model)
