"""The synthetic gpt-oss-20b: its plan at the real geometry is llama.cpp's tensor table for the
published MXFP4 file (names gpt-oss's in gguf-py, MXFP4 experts whatever the other matrices' type,
~12.1 GB as ggml-org's gpt-oss-20b-mxfp4.gguf), with the converter's keys; nothing is written."""

from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

from pagelm.quant.types import GGMLType
from pagelm.tools.synth import SHAPES, model_metadata, plan_model, plan_nbytes

F32, Q8_0, MXFP4 = GGMLType.F32, GGMLType.Q8_0, GGMLType.MXFP4


def test_the_plan_is_the_published_files_tensor_table():
    plan = {t.name: (t.dims, t.ggml_type) for t in plan_model(SHAPES["gpt-oss-20b"])}
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.GPT_OSS]}
    for name in plan:
        base, _, suffix = name.rpartition(".")
        parts = base.split(".")
        assert (".".join(["blk", "{bid}", *parts[2:]]) if parts[0] == "blk" else base) in known, name
        assert suffix in ("weight", "bias"), name
    layer = {name.removeprefix("blk.0."): v for name, v in plan.items() if name.startswith("blk.0.")}
    assert layer == {
        "attn_norm.weight": ((2880,), F32), "post_attention_norm.weight": ((2880,), F32),
        "attn_q.weight": ((2880, 4096), Q8_0), "attn_k.weight": ((2880, 512), Q8_0),
        "attn_v.weight": ((2880, 512), Q8_0), "attn_output.weight": ((4096, 2880), Q8_0),
        "attn_q.bias": ((4096,), F32), "attn_k.bias": ((512,), F32), "attn_v.bias": ((512,), F32),
        "attn_output.bias": ((2880,), F32), "attn_sinks.weight": ((64,), F32),
        "ffn_gate_inp.weight": ((2880, 32), F32), "ffn_gate_inp.bias": ((32,), F32),
        "ffn_gate_exps.weight": ((2880, 2880, 32), MXFP4), "ffn_up_exps.weight": ((2880, 2880, 32), MXFP4),
        "ffn_down_exps.weight": ((2880, 2880, 32), MXFP4), "ffn_gate_exps.bias": ((2880, 32), F32),
        "ffn_up_exps.bias": ((2880, 32), F32), "ffn_down_exps.bias": ((2880, 32), F32)}
    assert len([n for n in plan if n.endswith("_exps.weight")]) == 72
    assert plan["token_embd.weight"] == plan["output.weight"] == ((2880, 201_088), Q8_0)
    assert round(plan_nbytes(plan_model(SHAPES["gpt-oss-20b"])) / 1e9, 1) == 12.1
    mixed = {t.name: t.ggml_type for t in plan_model(SHAPES["gpt-oss-20b"], mix="q4_k_m")}
    assert mixed["blk.0.ffn_down_exps.weight"] == MXFP4  # every published gpt-oss GGUF keeps them so


def test_the_metadata_is_the_converters():
    md = model_metadata(SHAPES["gpt-oss-20b"])
    value = lambda key: getattr(md[f"gpt-oss.{key}"], "value", md[f"gpt-oss.{key}"])  # noqa: E731
    assert [value(k) for k in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
                               "attention.key_length", "expert_count", "expert_used_count",
                               "expert_feed_forward_length", "attention.sliding_window", "context_length",
                               "rope.scaling.original_context_length")] \
        == [24, 2880, 64, 8, 64, 32, 4, 2880, 128, 131_072, 4096]
    assert value("rope.scaling.type") == "yarn" and value("rope.scaling.factor") == 32.0
    assert value("rope.freq_base") == 150_000.0
