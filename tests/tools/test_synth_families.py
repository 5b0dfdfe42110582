"""Synthetic models of the other families (qwen3, qwen3moe, qwen35moe, qwen2, llama, lfm2, gemma-embedding): the plans
at the real geometries, the tiny files read back by gguf-py and pagelm, and the ones pagelm runs."""

import math
from dataclasses import replace
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

from pagelm.quant.types import GGMLType
from pagelm.tools.synth import SHAPES, model_metadata, plan_model, plan_nbytes, write_model
from pagelm.tools.synth_arch import llama3_rope_factors

F32, Q8_0, Q4_K, Q6_K = GGMLType.F32, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K
TINY = ["qwen3-tiny", "qwen3-30b-a3b-tiny", "qwen2.5-tiny", "llama3.2-tiny", "lfm2-tiny", "embeddinggemma-tiny"]


def _expected(arch, hidden, layers, ffn, heads, kv, head_dim, vocab, attention=None, dense=(), experts=None):
    """llama.cpp's tensor table of each architecture, written out by hand: name -> (ne dims, type).
    `experts`: (count, rows of each) of a mixture of experts, whose model has an untied head."""
    q, k = heads * head_dim, kv * head_dim
    final = "token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight"
    out = {"token_embd.weight": ((hidden, vocab), Q8_0), final: ((hidden,), F32)}
    if experts is not None:
        out["output.weight"] = ((hidden, vocab), Q8_0)
    for i in range(layers):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = ((hidden,), F32)
        out[b + "ffn_norm.weight"] = ((hidden,), F32)
        if experts is not None:
            n, rows = experts
            out[b + "ffn_gate_inp.weight"] = ((hidden, n), F32)
            out[b + "ffn_gate_exps.weight"] = out[b + "ffn_up_exps.weight"] = ((hidden, rows, n), Q8_0)
            out[b + "ffn_down_exps.weight"] = ((rows, hidden, n), Q8_0)
        else:
            out[b + "ffn_gate.weight"] = out[b + "ffn_up.weight"] = ((hidden, ffn), Q8_0)
            out[b + "ffn_down.weight"] = ((ffn, hidden), Q8_0)
        if attention is not None and i not in attention:  # lfm2's convolution layers
            out[b + "shortconv.in_proj.weight"] = ((hidden, 3 * hidden), Q8_0)
            out[b + "shortconv.conv.weight"] = ((3, hidden), F32)
            out[b + "shortconv.out_proj.weight"] = ((hidden, hidden), Q8_0)
            continue
        out[b + "attn_q.weight"] = ((hidden, q), Q8_0)
        out[b + "attn_k.weight"] = out[b + "attn_v.weight"] = ((hidden, k), Q8_0)
        out[b + "attn_output.weight"] = ((q, hidden), Q8_0)
        if arch == "qwen2":
            out[b + "attn_q.bias"], out[b + "attn_k.bias"], out[b + "attn_v.bias"] = ((q,), F32), ((k,), F32), ((k,), F32)
        if arch in ("qwen3", "qwen3moe", "lfm2", "gemma-embedding"):
            out[b + "attn_q_norm.weight"] = out[b + "attn_k_norm.weight"] = ((head_dim,), F32)
        if arch == "gemma-embedding":
            out[b + "post_attention_norm.weight"] = out[b + "post_ffw_norm.weight"] = ((hidden,), F32)
    if arch == "llama":
        out["rope_freqs.weight"] = ((head_dim // 2,), F32)
    widths = (hidden, *dense)
    for j in range(len(dense)):
        out[f"dense_{j + 2}.weight"] = ((widths[j], widths[j + 1]), Q8_0)
    return out


GEOMETRIES = {
    "qwen3-0.6b": dict(arch="qwen3", hidden=1024, layers=28, ffn=3072, heads=16, kv=8, head_dim=128, vocab=151936),
    "qwen3-1.7b": dict(arch="qwen3", hidden=2048, layers=28, ffn=6144, heads=16, kv=8, head_dim=128, vocab=151936),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden=1536, layers=28, ffn=8960, heads=12, kv=2, head_dim=128, vocab=151936),
    "llama3.2-1b": dict(arch="llama", hidden=2048, layers=16, ffn=8192, heads=32, kv=8, head_dim=64, vocab=128256),
    "lfm2-1.2b": dict(arch="lfm2", hidden=2048, layers=16, ffn=8192, heads=32, kv=8, head_dim=64, vocab=65536,
                      attention=(2, 5, 8, 10, 12, 14)),
    "embeddinggemma-300m": dict(arch="gemma-embedding", hidden=768, layers=24, ffn=1152, heads=3, kv=1, head_dim=256,
                                vocab=262144, dense=(3072, 768)),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, layers=48, ffn=6144, heads=32, kv=4, head_dim=128,
                          vocab=151936, experts=(128, 768)),
    "qwen3-tiny": dict(arch="qwen3", hidden=128, layers=2, ffn=256, heads=4, kv=2, head_dim=64, vocab=4096),
    "qwen3-30b-a3b-tiny": dict(arch="qwen3moe", hidden=128, layers=2, ffn=256, heads=4, kv=2, head_dim=32, vocab=4096,
                               experts=(8, 64)),
    "qwen2.5-tiny": dict(arch="qwen2", hidden=128, layers=2, ffn=256, heads=4, kv=2, head_dim=32, vocab=4096),
    "llama3.2-tiny": dict(arch="llama", hidden=128, layers=2, ffn=256, heads=4, kv=2, head_dim=32, vocab=4096),
    "lfm2-tiny": dict(arch="lfm2", hidden=128, layers=4, ffn=256, heads=4, kv=2, head_dim=32, vocab=4096,
                      attention=(1, 3)),
    "embeddinggemma-tiny": dict(arch="gemma-embedding", hidden=128, layers=6, ffn=192, heads=2, kv=1, head_dim=64,
                                vocab=4096, dense=(256, 128)),
}


def _table(plan):
    return {t.name: (t.dims, t.ggml_type) for t in plan}


@pytest.mark.parametrize("shape", list(GEOMETRIES))
def test_plan_is_llama_cpps_tensor_table(shape):
    plan = plan_model(SHAPES[shape])
    assert SHAPES[shape].arch == GEOMETRIES[shape]["arch"]
    assert _table(plan) == _expected(**GEOMETRIES[shape])
    assert len({t.name for t in plan}) == len(plan)


@pytest.mark.parametrize("shape", list(GEOMETRIES))
def test_tensor_names_are_gguf_pys(shape):
    """Every name is one gguf-py's constants list for the architecture (with .weight or .bias)."""
    arch = SHAPES[shape].arch
    (model_arch,) = [a for a, name in MODEL_ARCH_NAMES.items() if name == arch]
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[model_arch]}
    for t in plan_model(SHAPES[shape]):
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            base = ".".join(["blk", "{bid}", *parts[2:]])
        assert base in known and suffix in ("weight", "bias"), t.name


def test_real_geometry_sizes_and_metadata():
    # Q8_0 throughout (34 bytes a 32-value block), one tied table: about a gigabyte for llama3.2-1b
    assert round(plan_nbytes(plan_model(SHAPES["llama3.2-1b"])) / 2**20) == 1252
    assert round(plan_nbytes(plan_model(SHAPES["qwen3-0.6b"])) / 2**20) == 604
    md = model_metadata(SHAPES["qwen3-0.6b"])
    assert md["qwen3.attention.key_length"].value == 128 and md["qwen3.embedding_length"].value == 1024
    assert md["qwen3.rope.freq_base"].value == 1e6 and md["qwen3.context_length"].value == 40960
    assert md["tokenizer.ggml.model"] == "none"
    md = model_metadata(SHAPES["lfm2-1.2b"])
    assert md["lfm2.attention.head_count_kv"].value == (gguf.GGUFValueType.INT32,
                                                        [8 if i in (2, 5, 8, 10, 12, 14) else 0 for i in range(16)])
    assert md["lfm2.shortconv.l_cache"].value == 3 and md["lfm2.feed_forward_length"].value == 8192
    md = model_metadata(SHAPES["embeddinggemma-300m"])
    assert md["gemma-embedding.pooling_type"].value == 1 and md["gemma-embedding.attention.causal"] is False
    assert [md[f"gemma-embedding.dense_{n}_feat_{x}"].value for n in (2, 3) for x in ("in", "out")] == [768, 3072,
                                                                                                      3072, 768]
    assert md["gemma-embedding.attention.sliding_window"].value == 512


def test_q4_k_m_counts_attn_v_over_the_attention_layers():
    """llama.cpp's n_attention_wv counts attn_v tensors: 6 in lfm2-1.2b, so use_more_bits(i, 6) bumps
    the 3rd and 6th attention layers' attn_v (layers 8 and 14); ffn_down goes over all 16 layers."""
    plan = _table(plan_model(SHAPES["lfm2-1.2b"], mix="q4_k_m"))
    assert [n for n, (_, t) in plan.items() if n.endswith("attn_v.weight") and t == Q6_K] == [
        "blk.8.attn_v.weight", "blk.14.attn_v.weight"]
    assert [n for n, (_, t) in plan.items() if n.endswith("ffn_down.weight") and t == Q6_K] == [
        f"blk.{i}.ffn_down.weight" for i in (0, 1, 4, 7, 10, 13, 14, 15)]
    assert plan["token_embd.weight"][1] == Q6_K and plan["blk.0.shortconv.in_proj.weight"][1] == Q4_K
    gemma = _table(plan_model(SHAPES["embeddinggemma-300m"], mix="q4_k_m"))
    assert gemma["blk.0.ffn_down.weight"][1] == Q8_0  # 1152 is not whole 256-value blocks
    assert gemma["dense_2.weight"][1] == Q4_K


def test_q4_k_m_of_the_experts_is_llama_cpps():
    """qwen3-30b-a3b at Q4_K_M: Q4_K experts but ffn_down_exps Q6_K where use_more_bits bumps ffn_down,
    the router F32 (llama.cpp never quantizes ffn_gate_inp), token_embd Q4_K beside a Q6_K output;
    ~17.3 GiB, as the real file (18.6 GB); the experts' keys in the metadata."""
    plan = _table(plan_model(SHAPES["qwen3-30b-a3b"], mix="q4_k_m"))
    bumped = [i for i in range(48) if plan[f"blk.{i}.ffn_down_exps.weight"][1] == Q6_K]
    assert bumped == [i for i in range(48) if i < 6 or i >= 42 or (i - 6) % 3 == 2]
    assert all(plan[f"blk.{i}.ffn_down_exps.weight"][1] == Q4_K for i in range(48) if i not in bumped)
    assert plan["blk.0.ffn_gate_exps.weight"] == ((2048, 768, 128), Q4_K)
    assert plan["blk.0.ffn_gate_inp.weight"] == ((2048, 128), F32)
    assert plan["token_embd.weight"][1] == Q4_K and plan["output.weight"][1] == Q6_K
    assert round(plan_nbytes(plan_model(SHAPES["qwen3-30b-a3b"], mix="q4_k_m")) / 2**30, 1) == 17.3
    md = model_metadata(SHAPES["qwen3-30b-a3b"], mix="q4_k_m")
    assert [md[f"qwen3moe.{k}"].value for k in ("expert_count", "expert_used_count", "expert_feed_forward_length")] \
        == [128, 8, 768]


def test_llama3_rope_freqs_are_llama_cpps():
    """The factors as convert_hf_to_gguf.py's LlamaModel computes them, transcribed."""
    s = SHAPES["llama3.2-1b"]
    freqs = 1.0 / (500000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64))
    want = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            want.append(1.0)
        elif wavelen > 8192 / 1:
            want.append(32.0)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            want.append(1 / ((1 - smooth) / 32 + smooth))
    got = np.asarray(llama3_rope_factors(s), np.float32)
    np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=1e-5)
    assert got[0] == 1 and got[-1] == 32 and len(got) == 32


# ------------------------------------------------------------------------------ the files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    paths = {}
    for name in TINY:
        paths[name] = str(d / f"{name}.gguf")
        write_model(paths[name], SHAPES[name], seed=4, name=name)
    return paths


def _field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [int(f.parts[i][0]) for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]][0].item()


@pytest.mark.parametrize("shape", TINY)
def test_readers_read_every_planned_tensor(files, shape):
    from pagelm.formats.gguf import GGUFFile

    reader = gguf.GGUFReader(files[shape])
    plan = plan_model(SHAPES[shape])
    assert [t.name for t in reader.tensors] == [t.name for t in plan]
    for got, want in zip(reader.tensors, plan):
        assert tuple(int(n) for n in got.shape) == want.dims, want.name
        assert int(got.tensor_type) == int(want.ggml_type), want.name
        assert np.isfinite(gguf.quants.dequantize(got.data, got.tensor_type)).all(), want.name
    g = GEOMETRIES[shape]
    a = g["arch"]
    assert _field(reader, "general.architecture") == a
    assert _field(reader, f"{a}.embedding_length") == g["hidden"] and _field(reader, f"{a}.block_count") == g["layers"]
    assert _field(reader, f"{a}.attention.head_count") == g["heads"]
    assert _field(reader, f"{a}.attention.key_length") == g["head_dim"]
    assert _field(reader, "tokenizer.ggml.model") == "none"
    with GGUFFile.open(files[shape]) as f:
        assert list(f.tensors) == [t.name for t in plan]
        assert f.metadata["general.architecture"] == a


def test_family_keys_in_the_files(files):
    lfm2 = gguf.GGUFReader(files["lfm2-tiny"])
    assert _field(lfm2, "lfm2.attention.head_count_kv") == [0, 2, 0, 2]
    assert _field(lfm2, "lfm2.shortconv.l_cache") == 3
    gemma = gguf.GGUFReader(files["embeddinggemma-tiny"])
    assert _field(gemma, "gemma-embedding.pooling_type") == 1 and _field(gemma, "gemma-embedding.attention.causal") is False
    assert _field(gemma, "gemma-embedding.dense_2_feat_out") == 256
    llama = {t.name: t for t in gguf.GGUFReader(files["llama3.2-tiny"]).tensors}
    np.testing.assert_array_equal(np.asarray(llama["rope_freqs.weight"].data),
                                  np.asarray(llama3_rope_factors(SHAPES["llama3.2-tiny"]), np.float32))
    qwen2 = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(files["qwen2.5-tiny"]).tensors}
    assert 0.01 < qwen2["blk.0.attn_q.bias"].std() < 0.04


def test_same_seed_same_bytes(tmp_path, files):
    again, other = str(tmp_path / "again.gguf"), str(tmp_path / "other.gguf")
    write_model(again, SHAPES["lfm2-tiny"], seed=4, name="lfm2-tiny")
    write_model(other, SHAPES["lfm2-tiny"], seed=5, name="lfm2-tiny")
    original = open(files["lfm2-tiny"], "rb").read()
    assert open(again, "rb").read() == original and open(other, "rb").read() != original


@pytest.mark.parametrize("shape", ["qwen3-tiny", "qwen3-30b-a3b-tiny", "qwen2.5-tiny", "llama3.2-tiny", "lfm2-tiny"])
def test_pagelm_runs_the_decoders(files, shape):
    pytest.importorskip("torch")
    import pagelm
    from pagelm.engine.sampling import SamplingParams

    model = pagelm.load(files[shape], dtype="float32")
    session = model.session(32)
    tokens = list(session.generate([11, 22, 33, 44, 55], SamplingParams(max_tokens=4)))
    assert len(tokens) == 4 and all(0 <= t < 4096 for t in tokens)
    top2 = np.sort(session.logits)[-2:]
    assert np.isfinite(session.logits).all() and top2[1] - top2[0] > 0.5


def test_pagelm_embeds_with_embeddinggemma(files):
    pytest.importorskip("torch")
    from pagelm.engine.embed import Embedder
    from pagelm.engine.load import load_model

    embedder = Embedder.of(load_model(files["embeddinggemma-tiny"], dtype="float32"))
    assert embedder.dimensions == 128  # dense_3's width
    a, b = embedder.embed([5, 6, 7, 8, 9]), embedder.embed([5, 6, 7, 8, 10])
    assert a.shape == (128,) and np.isfinite(a).all() and abs(float(np.linalg.norm(a)) - 1) < 1e-5
    assert float(a @ b) < 0.999


def test_cli_writes_a_family_shape(tmp_path):
    path = str(tmp_path / "q3.gguf")
    result = subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", "qwen3-tiny", "--quiet", path],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "qwen3-tiny (qwen3), 2 layers" in result.stdout
    assert len(gguf.GGUFReader(path).tensors) == 24


# ------------------------------------------------------------------------------ qwen35moe


@pytest.mark.parametrize("shape", ["qwen3.5-35b-a3b", "qwen3.5-35b-a3b-tiny"])
def test_qwen35moe_plan_is_qwen35s_mixers_and_llama_cpps_experts(shape):
    """Each layer: qwen35's norms and mixers, as a dense Qwen3.5 of the same geometry has them (test_synth
    checks those against llama.cpp's table), then the router, the 3-D experts and the shared expert as
    llama.cpp's qwen35moe loader takes them; every name one gguf-py lists for qwen35moe."""
    s = SHAPES[shape]
    plan = _table(plan_model(s))
    dense = _table(plan_model(replace(s, arch="qwen35", ffn=256)))
    d, n, f, shared = s.hidden, s.n_experts, s.expert_ffn, s.shared_ffn
    assert {k: v for k, v in plan.items() if "ffn_" not in k} == {k: v for k, v in dense.items() if "ffn_" not in k}
    for i in range(s.n_layers):
        b = f"blk.{i}."
        assert {k: v for k, v in plan.items() if k.startswith(b + "ffn_")} == {
            b + "ffn_gate_inp.weight": ((d, n), F32),
            b + "ffn_gate_exps.weight": ((d, f, n), Q8_0), b + "ffn_up_exps.weight": ((d, f, n), Q8_0),
            b + "ffn_down_exps.weight": ((f, d, n), Q8_0),
            b + "ffn_gate_inp_shexp.weight": ((d,), F32),
            b + "ffn_gate_shexp.weight": ((d, shared), Q8_0), b + "ffn_up_shexp.weight": ((d, shared), Q8_0),
            b + "ffn_down_shexp.weight": ((shared, d), Q8_0)}
    assert plan["output.weight"] == ((d, s.vocab), Q8_0)  # untied
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[gguf.MODEL_ARCH.QWEN35MOE]}
    for name in plan:
        parts = name.removesuffix(".weight").removesuffix(".bias").split(".")  # ssm_a has neither suffix
        assert ".".join(["blk", "{bid}", *parts[2:]] if parts[0] == "blk" else parts) in known, name


def test_qwen35moe_real_geometry_and_its_q4_k_m():
    """qwen3.5-35b-a3b: 40 layers, 10 of them attention; ~34.4 GiB at Q8_0 (the real Q8_0 file: 36.9 GB) and
    ~19.7 GiB at Q4_K_M: Q4_K experts, ffn_down_exps and ffn_down_shexp Q6_K where use_more_bits bumps
    ffn_down, the router and the shared expert's gate F32, Q5_K attn_qkv, token_embd Q4_K beside a Q6_K
    output; the experts' keys in the metadata, and no feed_forward_length (no dense feed-forward)."""
    s = SHAPES["qwen3.5-35b-a3b"]
    assert (s.hidden, s.n_layers, s.n_experts, s.n_experts_used, s.expert_ffn, s.shared_ffn, s.vocab) == \
        (2048, 40, 256, 8, 512, 512, 248_320)
    assert round(plan_nbytes(plan_model(s)) / 2**30, 1) == 34.4
    plan = _table(plan_model(s, mix="q4_k_m"))
    for x in ("exps", "shexp"):
        bumped = [i for i in range(40) if plan[f"blk.{i}.ffn_down_{x}.weight"][1] == Q6_K]
        assert bumped == [i for i in range(40) if i < 5 or i >= 35 or (i - 5) % 3 == 2]
    assert plan["blk.0.ffn_gate_exps.weight"] == ((2048, 512, 256), Q4_K)
    assert plan["blk.6.ffn_down_exps.weight"][1] == Q4_K
    assert plan["blk.0.ffn_gate_inp.weight"][1] == plan["blk.0.ffn_gate_inp_shexp.weight"][1] == F32
    assert plan["blk.0.attn_qkv.weight"][1] == GGMLType.Q5_K
    assert plan["token_embd.weight"][1] == Q4_K and plan["output.weight"][1] == Q6_K
    assert round(plan_nbytes(plan_model(s, mix="q4_k_m")) / 2**30, 1) == 19.7
    md = model_metadata(s, mix="q4_k_m")
    assert [md[f"qwen35moe.{k}"].value for k in ("expert_count", "expert_used_count", "expert_feed_forward_length",
                                                 "expert_shared_feed_forward_length", "full_attention_interval")] \
        == [256, 8, 512, 512, 4]
    assert "qwen35moe.feed_forward_length" not in md and md["qwen35moe.rope.dimension_count"].value == 64
