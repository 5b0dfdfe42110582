"""Complete synthetic qwen35 models: the tensor plan, the file gguf-py reads back, metadata, values."""

import math
import os
import subprocess
import sys

import gguf
import gguf.quants
import numpy as np
import pytest

from pagelm.quant.types import GGMLType, row_nbytes
from pagelm.tools.synth import (
    LAYER_TYPES,
    MIXES,
    SHAPES,
    PlannedTensor,
    model_metadata,
    plan_model,
    plan_nbytes,
    table_value_std,
    tensor_chunks,
    use_more_bits,
    write_embedding_model,
    write_model,
)

F32, Q8_0, BF16 = GGMLType.F32, GGMLType.Q8_0, GGMLType.BF16
Q4_K, Q5_K, Q6_K = GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K
ATTENTION = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight",
             "attn_k_norm.weight", "attn_output.weight"]
DELTANET = ["attn_norm.weight", "attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight",
            "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight", "ssm_out.weight"]
MLP = ["post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]


def _expected(hidden, layers, ffn, heads, kv, head_dim, nk, nv, ssm_dim, vocab, embd=Q8_0, output=None, lt=Q8_0):
    """The tensor table of llama.cpp's qwen35 loader, written out by hand: name -> (ne dims, type)."""
    qkv = (2 * nk + nv) * ssm_dim
    out = {"token_embd.weight": ((hidden, vocab), embd), "output_norm.weight": ((hidden,), F32)}
    if output is not None:
        out["output.weight"] = ((hidden, vocab), output)
    for i in range(layers):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = ((hidden,), F32)
        out[b + "post_attention_norm.weight"] = ((hidden,), F32)
        out[b + "ffn_gate.weight"] = ((hidden, ffn), lt)
        out[b + "ffn_up.weight"] = ((hidden, ffn), lt)
        out[b + "ffn_down.weight"] = ((ffn, hidden), lt)
        if i % 4 == 3:
            out[b + "attn_q.weight"] = ((hidden, heads * 2 * head_dim), lt)
            out[b + "attn_k.weight"] = ((hidden, kv * head_dim), lt)
            out[b + "attn_v.weight"] = ((hidden, kv * head_dim), lt)
            out[b + "attn_output.weight"] = ((heads * head_dim, hidden), lt)
            out[b + "attn_q_norm.weight"] = ((head_dim,), F32)
            out[b + "attn_k_norm.weight"] = ((head_dim,), F32)
        else:
            out[b + "attn_qkv.weight"] = ((hidden, qkv), lt)
            out[b + "attn_gate.weight"] = ((hidden, nv * ssm_dim), lt)
            out[b + "ssm_beta.weight"] = ((hidden, nv), lt)
            out[b + "ssm_alpha.weight"] = ((hidden, nv), lt)
            out[b + "ssm_conv1d.weight"] = ((4, qkv), F32)
            out[b + "ssm_dt.bias"] = ((nv,), F32)
            out[b + "ssm_a"] = ((nv,), F32)
            out[b + "ssm_norm.weight"] = ((ssm_dim,), F32)
            out[b + "ssm_out.weight"] = ((nv * ssm_dim, hidden), lt)
    return out


def _table(plan):
    return {t.name: (t.dims, t.ggml_type) for t in plan}


TINY = dict(hidden=128, layers=4, ffn=256, heads=4, kv=2, head_dim=64, nk=2, ssm_dim=32, vocab=4096)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    paths = {}
    for name in ("qwen3.5-tiny", "qwen3.5-tiny-gqa"):
        paths[name] = str(d / f"{name}.gguf")
        write_model(paths[name], SHAPES[name], seed=5, name=name)
    return paths


# ------------------------------------------------------------------------------ the plan


@pytest.mark.parametrize("shape, geometry", [
    ("qwen3.5-0.8b", dict(hidden=1024, layers=24, ffn=3584, heads=8, kv=2, head_dim=256, nk=16, nv=16,
                          ssm_dim=128, vocab=248320)),
    ("qwen3.5-2b", dict(hidden=2048, layers=24, ffn=6144, heads=8, kv=2, head_dim=256, nk=16, nv=16,
                        ssm_dim=128, vocab=248320)),
    ("qwen3.5-4b", dict(hidden=2560, layers=32, ffn=9216, heads=16, kv=4, head_dim=256, nk=16, nv=32,
                        ssm_dim=128, vocab=248320)),
    ("qwen3.5-9b", dict(hidden=4096, layers=32, ffn=12288, heads=16, kv=4, head_dim=256, nk=16, nv=32,
                        ssm_dim=128, vocab=248320, embd=BF16, output=Q8_0)),
    ("qwen3.5-tiny", dict(TINY, nv=2)),
    ("qwen3.5-tiny-gqa", dict(TINY, nv=4)),
    ("qwen3.5-tiny-k", dict(TINY, hidden=256, layers=8, ffn=512, nv=4, ssm_dim=64)),
])
def test_plan_is_llama_cpp_qwen35_tensor_table(shape, geometry):
    plan = plan_model(SHAPES[shape])
    assert _table(plan) == _expected(**geometry)
    assert len({t.name for t in plan}) == len(plan)


def test_real_geometry_plans_spot_checks():
    p08 = _table(plan_model(SHAPES["qwen3.5-0.8b"]))
    assert "output.weight" not in p08  # tied
    assert p08["blk.3.attn_q.weight"] == ((1024, 4096), Q8_0)  # 8 heads x (256 query + 256 gate)
    assert p08["blk.0.attn_qkv.weight"] == ((1024, 6144), Q8_0)
    assert p08["blk.0.ssm_conv1d.weight"] == ((4, 6144), F32)
    assert sum(name.endswith("attn_q.weight") for name in p08) == 6  # layers 3, 7, ..., 23
    p4 = _table(plan_model(SHAPES["qwen3.5-4b"]))  # nv = 32 != nk = 16
    assert p4["blk.0.attn_qkv.weight"] == ((2560, 2 * 16 * 128 + 32 * 128), Q8_0)
    assert p4["blk.0.attn_gate.weight"] == ((2560, 4096), Q8_0)
    assert p4["blk.0.ssm_a"] == ((32,), F32) and p4["blk.0.ssm_out.weight"] == ((4096, 2560), Q8_0)
    p9 = plan_model(SHAPES["qwen3.5-9b"])
    assert [t.name for t in p9][-2:] == ["output_norm.weight", "output.weight"]
    assert _table(p9)["token_embd.weight"] == ((4096, 248320), BF16)
    assert _table(p9)["output.weight"] == ((4096, 248320), Q8_0)
    # Sizes: the Q8_0 0.8b is ~764 MiB of tensor data, of which the tied table is 257.7 MiB.
    assert plan_nbytes(p9) > 9 * 2**30
    assert round(plan_nbytes(plan_model(SHAPES["qwen3.5-0.8b"])) / 2**20) == 764
    assert row_nbytes(Q8_0, 1024) * 248320 / 2**20 == pytest.approx(257.7, abs=0.05)


@pytest.mark.parametrize("layer_type", sorted(LAYER_TYPES), ids=lambda t: t.name)
def test_layer_type_applies_to_the_matrices_only(layer_type):
    plan = plan_model(SHAPES["qwen3.5-4b"], layer_type)
    for t in plan:
        if t.name.startswith("blk.") and len(t.dims) == 2 and "conv1d" not in t.name:
            assert t.ggml_type == layer_type, t.name
        elif t.name.startswith("blk."):
            assert t.ggml_type == F32, t.name
    assert _table(plan)["token_embd.weight"][1] == Q8_0


def test_embedding_only_plan_and_shapes_without_layers():
    assert [t.name for t in plan_model(SHAPES["qwen3.5-9b"], embedding_only=True)] == ["token_embd.weight",
                                                                                       "output.weight"]
    assert [t.name for t in plan_model(SHAPES["tiny"], embedding_only=True)] == ["token_embd.weight"]
    with pytest.raises(ValueError, match="embedding geometry only"):
        plan_model(SHAPES["tiny"])
    with pytest.raises(ValueError, match="not supported"):
        plan_model(SHAPES["qwen3.5-tiny"], GGMLType.Q6_K)


# ------------------------------------------------------------------------------ --mix q4_k_m


def test_use_more_bits_is_llama_cpps_rule():
    assert [i for i in range(24) if use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(4) if use_more_bits(i, 4)] == [2, 3]


def test_mix_q4_k_m_on_the_0_8b_is_what_llama_cpp_wrote():
    """The type counts of a real Unsloth Qwen3.5-0.8B Q4_K_M file (peers.md): f32 ×133, q4_K ×152,
    q5_K ×18 (every attn_qkv), q6_K ×17 (token_embd, 12 ffn_down, 4 of the 6 attn_v)."""
    plan = _table(plan_model(SHAPES["qwen3.5-0.8b"], mix="q4_k_m"))
    counts = {}
    for _, t in plan.values():
        counts[t] = counts.get(t, 0) + 1
    assert counts == {F32: 133, Q4_K: 152, Q5_K: 18, Q6_K: 17}
    q6 = sorted(name for name, (_, t) in plan.items() if t == Q6_K)
    # attention layers 3, 7, ..., 23 are attn_v 0..5 of n_attention_wv = 24: 0, 1, 2 and 5 are bumped
    assert [n for n in q6 if "attn_v" in n] == sorted(f"blk.{i}.attn_v.weight" for i in (3, 7, 11, 23))
    assert plan["token_embd.weight"][1] == Q6_K and "output.weight" not in plan
    assert all(t == Q5_K for name, (_, t) in plan.items() if name.endswith("attn_qkv.weight"))
    assert plan["blk.0.ssm_conv1d.weight"][1] == F32
    untied = _table(plan_model(SHAPES["qwen3.5-9b"], mix="q4_k_m"))  # the head is output.weight there
    assert untied["output.weight"][1] == Q6_K and untied["token_embd.weight"][1] == Q4_K


def _q4_k_m_by_hand(name, dims, layers):
    """The tensor's Q4_K_M type, rules written out for an 8-layer model whose rows are all whole
    256-value blocks: attn_v counts over the attention layers 3 and 7 (index 0 and 1 of 8)."""
    if len(dims) == 1 or "ssm_conv1d" in name:
        return F32
    if name == "token_embd.weight":
        return Q6_K
    i = int(name.split(".")[1])
    if name.endswith("attn_qkv.weight"):
        return Q5_K
    if name.endswith("ffn_down.weight"):
        return Q6_K if i in (0, 3, 6, 7) else Q4_K
    if name.endswith("attn_v.weight"):
        return Q6_K if i == 3 else Q4_K
    return Q4_K


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mix") / "tiny-k-q4_k_m.gguf")
    _pagelm("synth", "--shape", "qwen3.5-tiny-k", "--mix", "q4_k_m", "--quiet", path)
    return path


def test_mix_q4_k_m_file_has_the_types_and_values(q4_k_m_file):
    reader = gguf.GGUFReader(q4_k_m_file)
    assert _field(reader, "general.file_type") == ([gguf.GGUFValueType.UINT32], MIXES["q4_k_m"]) == (
        [gguf.GGUFValueType.UINT32], 15)
    types = {t.name: GGMLType(int(t.tensor_type)) for t in reader.tensors}
    assert len(types) == 108
    for t in reader.tensors:
        dims = tuple(int(n) for n in t.shape)
        assert types[t.name] == _q4_k_m_by_hand(t.name, dims, 8), t.name
    assert {t for t in types.values()} == {F32, Q4_K, Q5_K, Q6_K}
    values = _values(reader)
    assert all(np.isfinite(v).all() for v in values.values())
    # token_embd is the Q8_0 table re-encoded in Q6_K, so the tied head keeps its scale
    q8 = str(q4_k_m_file) + ".q8_0.gguf"
    write_embedding_model(q8, SHAPES["qwen3.5-tiny-k"], seed=0)
    (table,) = _values(gguf.GGUFReader(q8)).values()
    assert np.abs(values["token_embd.weight"] - table).max() < 0.03 * np.abs(table).max()  # Q6_K, bf16-exact scales
    w = values["blk.0.ffn_gate.weight"]
    assert w.std() == pytest.approx(1 / math.sqrt(256), rel=0.05)


@pytest.mark.parametrize("weights", ["dense", "mapped"])
def test_mix_q4_k_m_model_loads_and_generates(q4_k_m_file, weights):
    pytest.importorskip("torch")
    import pagelm
    from pagelm.engine.sampling import SamplingParams

    model = pagelm.load(q4_k_m_file, weights=weights, dtype="float32")
    session = model.session(64)
    tokens = list(session.generate([11, 22, 33, 44, 55], SamplingParams(max_tokens=8)))
    assert len(tokens) == 8 and all(0 <= t < 4096 for t in tokens)
    assert np.isfinite(session.logits).all()
    top2 = np.sort(session.logits)[-2:]
    assert top2[1] - top2[0] > 0.5  # still peaked through K-quant layers


def test_mix_falls_back_to_q8_0_for_narrow_rows_and_excludes_layer_type(tmp_path):
    plan = _table(plan_model(SHAPES["qwen3.5-tiny"], mix="q4_k_m"))  # hidden 128, ffn 256
    assert plan["token_embd.weight"][1] == Q8_0  # Q6_K wanted, 128 wide
    assert plan["blk.0.ffn_gate.weight"][1] == Q8_0 and plan["blk.0.attn_qkv.weight"][1] == Q8_0
    assert plan["blk.0.ffn_down.weight"][1] == Q4_K  # 256 wide: n = 4 bumps layers 2 and 3 only
    assert plan["blk.2.ffn_down.weight"][1] == Q6_K and plan["blk.3.ffn_down.weight"][1] == Q6_K
    assert plan["blk.3.attn_output.weight"][1] == Q4_K  # 4 heads x 64
    with pytest.raises(ValueError, match="unknown mix"):
        plan_model(SHAPES["qwen3.5-tiny"], mix="q4_k_s")
    both = subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", "qwen3.5-tiny", "--mix", "q4_k_m",
                           "--layer-type", "Q8_0", str(tmp_path / "x.gguf")], capture_output=True, text=True)
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_chunks_are_bounded_for_the_big_shapes():
    (down,) = [t for t in plan_model(SHAPES["qwen3.5-9b"]) if t.name == "blk.0.ffn_down.weight"]
    chunk = next(iter(tensor_chunks(down, seed=0)))
    assert chunk.nbytes <= 8 << 20 and chunk.shape[1] == row_nbytes(Q8_0, 12288)


# ------------------------------------------------------------------------------ the files


@pytest.mark.parametrize("shape", ["qwen3.5-tiny", "qwen3.5-tiny-gqa"])
def test_gguf_py_reads_every_planned_tensor(tiny_files, shape):
    reader = gguf.GGUFReader(tiny_files[shape])
    plan = plan_model(SHAPES[shape])
    assert [t.name for t in reader.tensors] == [t.name for t in plan]
    for got, want in zip(reader.tensors, plan):
        assert tuple(int(n) for n in got.shape) == want.dims, want.name
        assert int(got.tensor_type) == int(want.ggml_type), want.name
        assert got.n_bytes == want.nbytes
    assert not os.path.exists(tiny_files[shape] + ".part")


def _field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return f.types, [int(f.parts[i][0]) for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return f.types, bytes(f.parts[f.data[0]]).decode()
    return f.types, f.parts[f.data[0]][0].item()


def test_metadata_keys_types_and_values(tiny_files):
    reader = gguf.GGUFReader(tiny_files["qwen3.5-tiny-gqa"])
    T = gguf.GGUFValueType
    u32 = {
        "block_count": 4, "context_length": 8192, "embedding_length": 128, "feed_forward_length": 256,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 64,
        "attention.value_length": 64, "rope.dimension_count": 16, "ssm.conv_kernel": 4, "ssm.state_size": 32,
        "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 128, "full_attention_interval": 4,
        "vocab_size": 4096,
    }
    for key, value in u32.items():
        assert _field(reader, f"qwen35.{key}") == ([T.UINT32], value), key
    types, eps = _field(reader, "qwen35.attention.layer_norm_rms_epsilon")
    assert types == [T.FLOAT32] and eps == pytest.approx(1e-6)
    assert _field(reader, "qwen35.rope.freq_base") == ([T.FLOAT32], 1e7)
    assert _field(reader, "qwen35.rope.dimension_sections") == ([T.ARRAY, T.INT32], [3, 3, 2, 0])
    assert _field(reader, "general.architecture") == ([T.STRING], "qwen35")
    assert _field(reader, "general.file_type") == ([T.UINT32], 7)  # MOSTLY_Q8_0


def test_real_geometry_metadata():
    md = model_metadata(SHAPES["qwen3.5-4b"])
    assert md["qwen35.rope.dimension_sections"].value == (gguf.GGUFValueType.INT32, [11, 11, 10, 0])
    assert md["qwen35.rope.dimension_count"].value == 64 and md["qwen35.rope.freq_base"].value == 1e7
    assert md["qwen35.ssm.inner_size"].value == 32 * 128 and md["qwen35.ssm.group_count"].value == 16
    assert md["qwen35.ssm.time_step_rank"].value == 32 and md["qwen35.ssm.state_size"].value == 128
    assert md["qwen35.attention.head_count"].value == 16 and md["qwen35.attention.head_count_kv"].value == 4


def test_same_seed_same_bytes(tmp_path, tiny_files):
    again, other = str(tmp_path / "again.gguf"), str(tmp_path / "other.gguf")
    write_model(again, SHAPES["qwen3.5-tiny"], seed=5, name="qwen3.5-tiny")
    write_model(other, SHAPES["qwen3.5-tiny"], seed=6, name="qwen3.5-tiny")
    original = open(tiny_files["qwen3.5-tiny"], "rb").read()
    assert open(again, "rb").read() == original
    assert open(other, "rb").read() != original


def _values(reader):
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.data.shape[0], -1)
            if t.tensor_type not in (gguf.GGMLQuantizationType.F32,) else np.asarray(t.data)
            for t in reader.tensors}


def test_values_follow_the_gguf_conventions(tiny_files):
    values = _values(gguf.GGUFReader(tiny_files["qwen3.5-tiny-gqa"]))
    for name, v in values.items():
        assert np.isfinite(v).all(), name
        if name.endswith(("attn_norm.weight", "post_attention_norm.weight", "q_norm.weight", "k_norm.weight",
                          "ssm_norm.weight")):
            assert abs(v.mean() - 1) < 0.05 and v.std() < 0.1, name  # +1 folded (ssm_norm: plain, ~1 too)
        if name.endswith("ssm_a"):
            assert (v < 0).all() and (v > -2).all()  # -exp(A_log)
        if name.endswith("ssm_dt.bias"):
            assert (-2 <= v).all() and (v <= -0.5).all()
    assert values["output_norm.weight"].mean() > 5  # scales the logits up
    w = values["blk.0.ffn_gate.weight"]
    assert w.std() == pytest.approx(1 / math.sqrt(128), rel=0.05)
    assert values["blk.0.ssm_conv1d.weight"].shape == (2 * 2 * 32 + 4 * 32, 4)  # numpy [C, K]


def test_full_model_token_embd_is_the_embedding_only_table(tmp_path, tiny_files):
    path = str(tmp_path / "embd.gguf")
    write_embedding_model(path, SHAPES["qwen3.5-tiny"], seed=5)
    (only,) = gguf.GGUFReader(path).tensors
    full = {t.name: t for t in gguf.GGUFReader(tiny_files["qwen3.5-tiny"]).tensors}
    assert np.array_equal(np.asarray(only.data), np.asarray(full["token_embd.weight"].data))


def test_final_logits_are_peaked(tiny_files):
    """Numpy stand-in for the last position: an RMS-normalised hidden state (random direction, the
    residual stream being a sum of random branches) times output_norm, against the tied table."""
    values = _values(gguf.GGUFReader(tiny_files["qwen3.5-tiny"]))
    table, w = values["token_embd.weight"], values["output_norm.weight"]
    h = np.random.default_rng(0).standard_normal((256, 128))
    h /= np.sqrt(np.mean(h * h, axis=1, keepdims=True))
    logits = (h * w) @ table.T
    top2 = np.sort(logits, axis=1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    assert logits.std(axis=1).mean() == pytest.approx(6 * math.sqrt(2 * math.log(4096)), rel=0.1)
    assert np.median(gaps) > 3 and np.mean(gaps < 1) < 0.25
    assert table_value_std(Q8_0) == pytest.approx(table.std(), rel=0.02)


# ------------------------------------------------------------------------------ the CLI


def _pagelm(*args):
    result = subprocess.run([sys.executable, "-m", "pagelm", *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result


def test_cli_writes_full_and_embedding_only_models(tmp_path):
    full, q4, embd = (str(tmp_path / n) for n in ("full.gguf", "q4.gguf", "embd.gguf"))
    out = _pagelm("synth", "--shape", "qwen3.5-tiny-gqa", "--seed", "2", full).stdout
    assert "55 tensors" in out
    _pagelm("synth", "--shape", "qwen3.5-tiny-gqa", "--layer-type", "Q4_0", "--quiet", q4)
    _pagelm("synth", "--shape", "qwen3.5-tiny-gqa", "--embedding-only", "--quiet", embd)
    assert len(gguf.GGUFReader(full).tensors) == 55
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(q4).tensors}
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert types["blk.0.ssm_conv1d.weight"] == gguf.GGMLQuantizationType.F32
    assert [t.name for t in gguf.GGUFReader(embd).tensors] == ["token_embd.weight"]


def test_planned_tensor_shape_is_numpy_order():
    t = PlannedTensor("x", (4, 6144), F32, None)
    assert t.shape == (6144, 4) and t.nbytes == 4 * 6144 * 4


@pytest.mark.parametrize("shape", ["qwen3.5-tiny", "qwen3.5-tiny-gqa"])
def test_margin_through_pagelm_qwen35_model(tiny_files, shape):
    """The last position's logits through pagelm's own qwen35 decoder (fp32): peaked, finite."""
    torch = pytest.importorskip("torch")
    qwen35 = pytest.importorskip("pagelm.models.qwen35")
    from pagelm.formats.gguf import GGUFFile
    from pagelm.quant import decode_f32
    from pagelm.weights.loader import WeightLoader

    with GGUFFile.open(tiny_files[shape]) as f:
        loader = WeightLoader(f, "mapped", torch.float32)
        config = qwen35.Qwen35Config.from_loader(loader)
        net = qwen35.Qwen35Model(config, loader)
        info = f.tensors["token_embd.weight"]
        raw = np.asarray(f.tensor_data("token_embd.weight")).reshape(-1, info.row_nbytes)
        table = torch.from_numpy(decode_f32(raw, info.ggml_type))
        rng = np.random.default_rng(11)
        gaps, echoes = [], 0
        for _ in range(16):
            ids = torch.from_numpy(rng.integers(0, 4096, 24))
            logits = net.forward(table[ids], net.new_state(24))[-1] @ table.T
            assert torch.isfinite(logits).all()
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            echoes += int(logits.argmax()) == int(ids[-1])
        del net
    assert np.median(gaps) > 2.5, gaps
    assert echoes <= 2  # the tied head does not just repeat the input token


def test_an_mtp_layer_follows_the_trunk_as_llama_cpp_names_it(tmp_path):
    """gguf-py's own names for a NextN layer (blk.N.nextn.*) and key ({arch}.nextn_predict_layers)."""
    from dataclasses import replace

    shape = SHAPES["qwen3.5-tiny-gqa"]
    n = shape.n_layers
    plan = plan_model(replace(shape, mtp_layers=1))
    trunk = plan_model(shape)
    nextn = {gguf.TENSOR_NAMES[t].format(bid=n) + ".weight" for t in gguf.TENSOR_NAMES
             if ".nextn." in gguf.TENSOR_NAMES[t]}
    added = {t.name for t in plan} - {t.name for t in trunk}
    assert {name for name in added if ".nextn." in name} <= nextn
    assert {name.split(".", 2)[2] for name in added} == {
        "nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
        "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
        "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "ffn_gate.weight",
        "ffn_up.weight", "ffn_down.weight"}
    assert {t.name: t.dims for t in plan}[f"blk.{n}.nextn.eh_proj.weight"] == (2 * shape.hidden, shape.hidden)
    path = str(tmp_path / "mtp.gguf")
    _pagelm("synth", "--shape", "qwen3.5-tiny-gqa", "--mtp", "--quiet", path)
    fields = gguf.GGUFReader(path).fields
    keys = gguf.Keys.LLM
    assert fields[keys.BLOCK_COUNT.format(arch="qwen35")].contents() == n + 1
    assert fields[keys.NEXTN_PREDICT_LAYERS.format(arch="qwen35")].contents() == 1
    refused = subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", "qwen3-0.6b", "--mtp", path],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "not a complete Qwen3.5" in refused.stderr
