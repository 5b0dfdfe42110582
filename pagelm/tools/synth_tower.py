"""Random Qwen3.5 vision towers (mmproj GGUF) with the real geometries, or with given values: the
plan of every tensor, llama.cpp's metadata, a streamed writer.

Owns the towers' shapes and value scales; reading a tower is `pagelm.vision.mmproj`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant import GGMLType, encode
from pagelm.tools.synth import Init, PlannedTensor, table_value_std, tensor_chunks
from pagelm.vision.mmproj import ARCH, CHANNELS, PROJECTOR, TEMPORAL_PATCH, VisionConfig

MATRIX_TYPES = (GGMLType.F16, GGMLType.F32, GGMLType.BF16)
_FILE_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.BF16: 32}  # llama_ftype of a float mmproj

SHAPES: dict[str, VisionConfig] = {
    "qwen3.5-0.8b": VisionConfig(depth=12, hidden=768, heads=12, intermediate=3072, out_hidden=1024),
    "qwen3.5-2b": VisionConfig(depth=24, hidden=1024, heads=16, intermediate=4096, out_hidden=2048),
    "qwen3.5-4b": VisionConfig(depth=24, hidden=1024, heads=16, intermediate=4096, out_hidden=2560),
    "qwen3.5-9b": VisionConfig(depth=27, hidden=1152, heads=16, intermediate=4304, out_hidden=4096),
    # tiny towers for the tiny text shapes of the same names (synth.SHAPES): out_hidden is their width
    **{name: VisionConfig(depth=2, hidden=64, heads=4, intermediate=128, out_hidden=128)
       for name in ("qwen3.5-tiny", "qwen3.5-tiny-gqa", "qwen3.5-tiny-chat")},
    "qwen3.5-tiny-k": VisionConfig(depth=2, hidden=64, heads=4, intermediate=128, out_hidden=256),
}

# Scales of the random values: every projection is drawn as N(0, gain / sqrt(fan_in)), so that
# the output of a LayerNormed input has rms ~ gain; each residual branch adds rms ~
# 1 / sqrt(2·depth), so the stream stays O(1) through all blocks.
_INPUT_RMS = 0.5  # rough rms of normalised pixels (−1 .. 1)
_POSITION_RMS = 0.5
_BIAS_RMS = 0.02
_NORM_NOISE = 0.05  # LayerNorm weights are 1 + N(0, _NORM_NOISE)
_GELU_RMS = 0.65  # rms of gelu(x) for x ~ N(0, 1)


def plan_mmproj(c: VisionConfig, matrix_type: GGMLType = GGMLType.F16) -> list[PlannedTensor]:
    """Every tensor of the mmproj in file order: name, ggml dims, type and value distribution.

    Matrices (and the patch kernel and position table, as llama.cpp's converter types them) in
    `matrix_type`; norms and biases F32. The tower's output rms is the synthetic token
    embeddings' (synth.table_value_std of Q8_0), so a synthetic language model sees image
    tokens at the scale of text tokens.
    """
    if matrix_type not in MATRIX_TYPES:
        raise ValueError(f"mmproj matrices of type {GGMLType(matrix_type).name} are not supported "
                         f"(supported: {', '.join(t.name for t in MATRIX_TYPES)})")
    c.validate()
    F32 = GGMLType.F32
    h, m = c.hidden, c.merged_hidden
    branch = 1 / math.sqrt(2 * c.depth)
    out_rms = table_value_std(GGMLType.Q8_0)

    def normal(scale: float, center: float = 0.0) -> Init:
        return Init("normal", scale=scale, center=center)

    def matrix(name: str, n_in: int, n_out: int, gain: float = 1.0) -> PlannedTensor:
        return PlannedTensor(name, (n_in, n_out), matrix_type, normal(gain / math.sqrt(n_in)))

    def bias(name: str, n: int, scale: float = _BIAS_RMS) -> PlannedTensor:
        return PlannedTensor(name, (n,), F32, normal(scale))

    def norm(prefix: str, n: int) -> list[PlannedTensor]:
        return [PlannedTensor(prefix + ".weight", (n,), F32, normal(_NORM_NOISE, 1.0)), bias(prefix + ".bias", n)]

    kernel = (c.patch_size, c.patch_size, CHANNELS, h)
    # both slices see the same pixels: each at half the variance keeps the patch embedding at the input's rms
    kernel_scale = 1 / (_INPUT_RMS * math.sqrt(TEMPORAL_PATCH * CHANNELS * c.patch_size**2))
    plan = [
        PlannedTensor("v.patch_embd.weight", kernel, matrix_type, normal(kernel_scale)),
        PlannedTensor("v.patch_embd.weight.1", kernel, matrix_type, normal(kernel_scale)),
        bias("v.patch_embd.bias", h),
        PlannedTensor("v.position_embd.weight", (h, c.position_side**2), matrix_type, normal(_POSITION_RMS)),
    ]
    for i in range(c.depth):
        p = f"v.blk.{i}."
        plan += [
            *norm(p + "ln1", h),
            matrix(p + "attn_qkv.weight", h, 3 * h), bias(p + "attn_qkv.bias", 3 * h),
            matrix(p + "attn_out.weight", h, h, branch), bias(p + "attn_out.bias", h),
            *norm(p + "ln2", h),
            matrix(p + "ffn_up.weight", h, c.intermediate), bias(p + "ffn_up.bias", c.intermediate),
            matrix(p + "ffn_down.weight", c.intermediate, h, branch / _GELU_RMS), bias(p + "ffn_down.bias", h),
        ]
    return plan + [
        *norm("v.post_ln", h),
        matrix("mm.0.weight", m, m), bias("mm.0.bias", m),
        matrix("mm.2.weight", m, c.out_hidden, out_rms / _GELU_RMS), bias("mm.2.bias", c.out_hidden, 0.1 * out_rms),
    ]


def mmproj_metadata(c: VisionConfig, matrix_type: GGMLType = GGMLType.F16, seed: int = 0,
                    name: str = "synthetic") -> dict:
    """The GGUF metadata llama.cpp's converter writes for a Qwen3.5 tower, with its value types."""
    u32 = lambda v: Typed(GGUFValueType.UINT32, v)  # noqa: E731
    f32s = lambda v: Typed(GGUFValueType.ARRAY, (GGUFValueType.FLOAT32, list(v)))  # noqa: E731
    v = "clip.vision."
    return {
        "general.architecture": ARCH,
        "general.type": "mmproj",
        "general.name": name,
        "general.file_type": u32(_FILE_TYPE[matrix_type]),
        "clip.projector_type": PROJECTOR,
        "clip.has_vision_encoder": True,
        "clip.use_gelu": True,
        v + "image_size": u32(c.position_side * c.patch_size),
        v + "patch_size": u32(c.patch_size),
        v + "embedding_length": u32(c.hidden),
        v + "feed_forward_length": u32(c.intermediate),
        v + "block_count": u32(c.depth),
        v + "attention.head_count": u32(c.heads),
        v + "attention.layer_norm_epsilon": Typed(GGUFValueType.FLOAT32, c.layer_norm_eps),
        v + "projection_dim": u32(c.out_hidden),
        v + "spatial_merge_size": u32(c.merge_size),
        v + "image_mean": f32s(c.image_mean),
        v + "image_std": f32s(c.image_std),
        v + "is_deepstack_layers": Typed(GGUFValueType.ARRAY, (GGUFValueType.BOOL, [False] * c.depth)),
        "pagelm.synthetic.seed": Typed(GGUFValueType.UINT64, seed),
    }


def _given_chunks(t: PlannedTensor, values: np.ndarray) -> list[np.ndarray]:
    array = np.asarray(values, np.float32)
    if array.shape != t.shape:
        raise ValueError(f"tensor '{t.name}': given values of shape {array.shape}, expected {t.shape} (numpy order)")
    return [encode(array.reshape(-1, t.dims[0]), t.ggml_type)]


def write_mmproj(
    path: str,
    config: VisionConfig,
    seed: int = 0,
    matrix_type: GGMLType = GGMLType.F16,
    values: Mapping[str, np.ndarray] | None = None,
    name: str = "synthetic",
    progress: Callable[[int], None] | None = None,
) -> list[PlannedTensor]:
    """Write a Qwen3.5 vision tower as llama.cpp's mmproj GGUF; returns its plan.

    Values are drawn per tensor from `seed` (see plan_mmproj), except those in `values` (numpy
    order, float32; e.g. a converted transformers tower), which are written as given. Streams
    each tensor in bounded chunks to `path.part`, renamed onto `path` when complete.
    """
    plan = plan_mmproj(config, matrix_type)
    values = dict(values or {})
    unknown = set(values) - {t.name for t in plan}
    if unknown:
        raise ValueError(f"values given for tensors the tower does not have: {', '.join(sorted(unknown))}")
    tensors = [TensorToWrite(t.name, t.dims, t.ggml_type,
                             _given_chunks(t, values[t.name]) if t.name in values else tensor_chunks(t, seed))
               for t in plan]
    write_gguf(path, mmproj_metadata(config, matrix_type, seed, name), tensors, progress=progress)
    return plan
