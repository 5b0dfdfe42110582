"""FastFlowLM directories (`synth --format flm`): the tiles hold the GGUF's values bit for bit, the
model computes what its Hugging Face twin computes, both Q8 code orders and their detection, the
bf16 copies as a check of the decoder, and directories that are wrong."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagelm.cli import main
from pagelm.engine.load import load_model
from pagelm.errors import ModelFormatError, PagelmError
from pagelm.formats.safetensors import SafetensorsFile, TensorToWrite, write_safetensors
from pagelm.models import hf_layouts
from pagelm.weights.flm import MODEL_FILE, FLMCheckpoint, copy_name
from pagelm.weights.loader import dequantize_tensor, open_checkpoint

SHAPE = "qwen3.5-tiny-k"  # every matrix row is whole 256-value blocks; value heads outnumber key heads
LAYER_TYPES = {"q8_0": ["--layer-type", "Q8_0"], "q4_1": ["--layer-type", "Q4_1"], "q4_k_m": ["--mix", "q4_k_m"]}
PROMPT = list(range(100, 124))
REL_TOL = 1e-3  # the twin's head and F32 matrices sum in another order; the chaotic random model amplifies it


def _synth(out, *args) -> None:
    assert main(["synth", "--shape", SHAPE, "--quiet", *args, str(out)]) == 0


@pytest.fixture(scope="module", params=list(LAYER_TYPES))
def twins(request, tmp_path_factory):
    """(GGUF, FastFlowLM dir, Hugging Face f32 dir) of one random model."""
    root = tmp_path_factory.mktemp(f"flm-{request.param}")
    types = LAYER_TYPES[request.param]
    paths = root / "m.gguf", root / "m-flm", root / "m-hf"
    _synth(paths[0], *types)
    _synth(paths[1], *types, "--format", "flm", "--hf-dtype", "f32")
    _synth(paths[2], *types, "--format", "hf", "--hf-dtype", "f32")
    return tuple(map(str, paths))


def test_tiles_hold_the_ggufs_values_bit_for_bit(twins):
    gguf_path, flm_path, _ = twins
    with open_checkpoint(gguf_path, hf_layouts) as gguf, open_checkpoint(flm_path, hf_layouts) as flm:
        assert isinstance(flm, FLMCheckpoint) and flm.tiles
        assert "output.weight" not in flm.tiles and "output.weight" not in flm.tensors  # tied
        assert flm.conversion("token_embd.weight").hf == "lm_head.weight"  # the only copy of the embeddings
        for name, matrix in flm.tiles.items():
            rows = flm.conversion(name).rows
            stored = matrix.values()
            assert np.array_equal(stored if rows is None else stored[rows], dequantize_tensor(gguf, name).numpy()), name


def _teacher_forced(path: str, weights: str) -> np.ndarray:
    session = load_model(path, weights=weights).session(len(PROMPT) + 8)
    logits = [session.prefill(PROMPT)]
    for token in range(40, 48):
        logits.append(session.decode(token))
    return np.stack(logits)


@pytest.mark.parametrize("weights", ["mapped", "dense"])
def test_the_model_computes_what_its_hf_twin_computes(twins, weights):
    _, flm_path, hf_path = twins
    flm, hf = _teacher_forced(flm_path, weights), _teacher_forced(hf_path, weights)
    assert np.abs(flm - hf).max() <= REL_TOL * np.abs(hf).max()
    assert np.array_equal(flm.argmax(axis=1), hf.argmax(axis=1))


def test_mapped_prefill_is_bit_identical_to_dense(twins):
    _, flm_path, _ = twins
    mapped = load_model(flm_path, weights="mapped").session(64).prefill(PROMPT)
    dense = load_model(flm_path, weights="dense").session(64).prefill(PROMPT)
    assert np.array_equal(mapped, dense)


def _edit_config(path, **changes) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as fh:
        config = json.load(fh)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(config_path, "w") as fh:
        json.dump(config, fh)


def _rewrite(path, edit) -> None:
    """Rewrite model.q4nx with `edit(name, dtype, array) -> (dtype, array) | None (dropped)` per tensor."""
    model = os.path.join(path, MODEL_FILE)
    with SafetensorsFile.open(model) as f:
        tensors = []
        for name, info in f.tensors.items():
            edited = edit(name, info.dtype, np.array(f.tensor(name)))
            if edited is not None:
                tensors.append(TensorToWrite(name, edited[0], edited[1].shape, lambda a=edited[1]: a))
        write_safetensors(model + ".new", tensors)
    os.replace(model + ".new", model)


@pytest.fixture(scope="module")
def q8_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flm-versions")
    _synth(root / "new", "--format", "flm")
    _synth(root / "old", "--format", "flm", "--flm-version", "1.0.2")
    return str(root / "new"), str(root / "old")


def test_both_q8_code_orders_read_the_same_values(q8_dirs, tmp_path):
    new, old = q8_dirs
    with open_checkpoint(new, hf_layouts) as a, open_checkpoint(old, hf_layouts) as b:
        assert {m.kind.name for m in b.tiles.values()} == {"Q8_V102"}
        for name in a.tiles:
            assert np.array_equal(a.tiles[name].values(), b.tiles[name].values()), name
    # without flm_version, the bf16 copies tell the order
    unversioned = shutil.copytree(old, tmp_path / "unversioned")
    _edit_config(unversioned, flm_version=None)
    with open_checkpoint(str(unversioned), hf_layouts) as c:
        assert {m.kind.name for m in c.tiles.values()} == {"Q8_V102"}
    # a version that contradicts the tiles is caught by the copies
    _edit_config(unversioned, flm_version="1.0.3")
    with pytest.raises(ModelFormatError, match="ssm_.*_proj.weight' decodes to values further from its bf16 copy"):
        open_checkpoint(str(unversioned), hf_layouts)
    # no version and no copy: nothing can tell, and pagelm says what to add
    _edit_config(unversioned, flm_version=None)
    _rewrite(unversioned, lambda name, dtype, a: None if ".bf16." in name else (dtype, a))
    with pytest.raises(ModelFormatError, match='add "flm_version" to config.json'):
        open_checkpoint(str(unversioned), hf_layouts)


def test_verify_embeddings_checks_rows_and_copies(q8_dirs):
    out = subprocess.run([sys.executable, "-m", "pagelm", "verify-embeddings", q8_dirs[1]],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "FastFlowLM Q8_V102 tiles, 4096 of 4096 rows" in out.stdout
    assert "tiles vs stored bf16 copies: 12 tensors, 12288 values checked, 0 further" in out.stdout
    assert out.stdout.rstrip().endswith("rows: 4096 checked, 0 differing")


def _broken(q8_dirs, tmp_path, edit=None, **config) -> str:
    path = str(shutil.copytree(q8_dirs[0], tmp_path / "broken"))
    if edit is not None:
        _rewrite(path, edit)
    if config:
        _edit_config(path, **config)
    return path


GATE = "model.layers.1.mlp.gate_proj.weight"
BETA = "model.layers.1.linear_attn.ssm_beta_proj.weight"


@pytest.mark.parametrize("edit,config,words", [
    (lambda n, d, a: (d, a[..., :1000]) if n == GATE else (d, a), {}, f"'{GATE}': I8 [16, 1, 1000], expected tiles"),
    (lambda n, d, a: (d, a[:2]) if n == GATE else (d, a), {}, "holds 64 × 256 values, expected 512 × 256"),
    (lambda n, d, a: None if n == GATE else (d, a), {}, "tensor 'blk.1.ffn_gate.weight' missing"),
    (lambda n, d, a: (d, a[:, :128]) if n == copy_name(BETA) else (d, a), {}, f"'{copy_name(BETA)}' is BF16 [4, 128]"),
    (lambda n, d, a: (d, a[:3]) if n == copy_name(BETA) else (d, a), {}, "holds 3 × 256 values, expected 4 × 256"),
    (lambda n, d, a: ("F32", np.zeros(a.shape, np.float32)) if n == copy_name(BETA) else (d, a), {}, "BF16 copy"),
    (None, {"hidden_size": 512}, "expected"),
    (None, {"flm_version": "one.0"}, "flm_version is 'one.0'"),
])
def test_broken_directories_name_the_file_and_the_problem(q8_dirs, tmp_path, edit, config, words):
    path = _broken(q8_dirs, tmp_path, edit, **config)
    with pytest.raises(PagelmError, match=re.escape(words)):
        load_model(path)


def test_a_truncated_model_file_is_refused(q8_dirs, tmp_path):
    path = _broken(q8_dirs, tmp_path)
    model = os.path.join(path, MODEL_FILE)
    with open(model, "r+b") as fh:
        fh.truncate(os.path.getsize(model) - 1)
    with pytest.raises(ModelFormatError, match="model.q4nx"):
        load_model(path)


NUMBERS = [0, 1, 3, 4, 8, 31, 32, 33, 255, 256, 257, 4736, 5120, 8704, 2**31, 2**40, 2**64]
DTYPES = ["I8", "U8", "BF16", "F16", "F32", "I64", "BOOL"]
EDITS = st.lists(st.tuples(st.sampled_from(["number", "dtype", "char"]), st.integers(0, 1 << 20), st.integers(0, 1 << 20)),
                 min_size=1, max_size=3)


@pytest.fixture(scope="module")
def fuzz_dir(q8_dirs, tmp_path_factory):
    path = str(shutil.copytree(q8_dirs[0], tmp_path_factory.mktemp("fuzz") / "m"))
    with open(os.path.join(path, MODEL_FILE), "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header, data = fh.read(size).decode(), fh.read()
    return path, header, data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=EDITS)
def test_mutated_headers_fail_cleanly(fuzz_dir, edits):
    """model.q4nx's header with shapes, offsets, dtypes and names edited: the directory opens and
    computes, or a PagelmError says why (never another exception)."""
    path, text, data = fuzz_dir
    for op, a, b in edits:
        if op == "number":
            found = list(re.finditer(r"\d+", text))
            m = found[a % len(found)]
            text = text[: m.start()] + str(NUMBERS[b % len(NUMBERS)]) + text[m.end() :]
        elif op == "dtype":
            found = list(re.finditer(r'"(I8|BF16|F32)"', text))
            m = found[a % len(found)]
            text = text[: m.start()] + f'"{DTYPES[b % len(DTYPES)]}"' + text[m.end() :]
        else:
            at = a % len(text)
            text = text[:at] + chr(32 + b % 95) + text[at + 1 :]
    header = text.encode()
    with open(os.path.join(path, MODEL_FILE), "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header + data)
    try:
        load_model(path).session(8).prefill([1, 2, 3])
    except PagelmError:
        pass


def test_run_answers_from_a_directory_with_a_tokenizer(tmp_path):
    path = tmp_path / "chat-flm"
    assert main(["synth", "--shape", "qwen3.5-tiny-chat", "--format", "flm", "--quiet", str(path)]) == 0
    assert sorted(os.listdir(path)) == ["chat_template.jinja", "config.json", "generation_config.json", MODEL_FILE,
                                        "tokenizer.json", "tokenizer_config.json"]
    answer = subprocess.run([sys.executable, "-m", "pagelm", "run", str(path), "Hello", "--max-tokens", "4", "--json"],
                            capture_output=True, text=True)
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout.strip().splitlines()[-1])["completion_tokens"] >= 1
