"""Qwen3.5's vision tower as llama.cpp ships it: an "mmproj" GGUF (`general.architecture = clip`,
`clip.projector_type = qwen3vl_merger`) beside the language model.

Owns the file's keys and tensor names: `VisionConfig` read from them, the tower's weights taken
through a `WeightLoader` (matrices as operators in the loader's weights mode, small tensors as
float32), and a streamed writer of random towers with the real geometries (or of given values).
Never computes a forward pass (`vision.tower` does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.gguf import GGUFArray, GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant import GGMLType, encode
from pagelm.synth import Init, PlannedTensor, table_value_std, tensor_chunks
from pagelm.weights.linear import Linear
from pagelm.weights.loader import WeightLoader

ARCH = "clip"
PROJECTOR = "qwen3vl_merger"
CHANNELS = 3
# A still image is the same frame twice: the Conv3d's kernel spans 2 frames, stored as two slices
# (`v.patch_embd.weight` and `v.patch_embd.weight.1`).
TEMPORAL_PATCH = 2
MATRIX_TYPES = (GGMLType.F16, GGMLType.F32, GGMLType.BF16)
_FILE_TYPE = {GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.BF16: 32}  # llama_ftype of a float mmproj


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden: int
    heads: int
    intermediate: int
    out_hidden: int  # the language model's width (clip.vision.projection_dim)
    patch_size: int = 16
    merge_size: int = 2  # merge_size × merge_size patches become one token
    position_side: int = 48  # the learned position table has position_side² rows
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0  # transformers' default; the mmproj file has no key for it
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patch_values(self) -> int:
        """Values of one input row: channels × frames × patch × patch (1,536)."""
        return CHANNELS * TEMPORAL_PATCH * self.patch_size**2

    @property
    def merged_hidden(self) -> int:
        return self.merge_size**2 * self.hidden

    @classmethod
    def from_loader(cls, model: WeightLoader) -> VisionConfig:
        where = model.name
        arch = model.architecture
        if arch != ARCH:
            raise ModelFormatError(f"{where}: metadata key 'general.architecture' is {arch!r:.40}, expected "
                                   f"'{ARCH}' (a vision tower's mmproj file)")
        projector = model.get("clip.projector_type", model.get("clip.vision.projector_type"))
        if projector is None:
            raise ModelFormatError(f"{where}: metadata key 'clip.projector_type' missing")
        if projector != PROJECTOR:
            raise UnsupportedError(f"{where}: metadata key 'clip.projector_type' is {projector!r:.40}; pagelm reads "
                                   f"Qwen3.5's '{PROJECTOR}' towers only")
        if model.get("clip.has_vision_encoder") is not True:
            raise ModelFormatError(f"{where}: metadata key 'clip.has_vision_encoder' is not true")
        deepstack = model.get("clip.vision.is_deepstack_layers")
        if deepstack is not None and any(deepstack):
            raise UnsupportedError(f"{where}: metadata key 'clip.vision.is_deepstack_layers' marks deepstack layers "
                                   f"(Qwen3-VL's); Qwen3.5's tower has none and pagelm computes none")

        def i(key: str) -> int:
            return model.get_int(f"clip.vision.{key}")

        hidden = i("embedding_length")
        table = model.dims("v.position_embd.weight")
        side = math.isqrt(table[-1])
        if len(table) != 2 or table[0] != hidden or side * side != table[1]:
            raise ModelFormatError(f"{where}: tensor 'v.position_embd.weight' has dims {table} (ne0 first), "
                                   f"expected ({hidden}, a square number of positions)")
        eps_key = "clip.vision.attention.layer_norm_epsilon"
        config = cls(
            depth=i("block_count"),
            hidden=hidden,
            heads=i("attention.head_count"),
            intermediate=i("feed_forward_length"),
            out_hidden=i("projection_dim"),
            patch_size=i("patch_size"),
            merge_size=i("spatial_merge_size"),
            position_side=side,
            layer_norm_eps=model.get_float(eps_key) if model.has(eps_key) else 1e-6,
            image_mean=_channel_floats(model, "clip.vision.image_mean"),
            image_std=_channel_floats(model, "clip.vision.image_std"),
        )
        config.validate(where)
        return config

    def validate(self, where: str = "vision config") -> None:
        for name in ("depth", "hidden", "heads", "intermediate", "out_hidden", "patch_size", "merge_size",
                     "position_side"):
            if getattr(self, name) < 1:
                raise ModelFormatError(f"{where}: {name} is {getattr(self, name)}, expected >= 1")
        checks = (
            (self.hidden % self.heads == 0,
             f"clip.vision.embedding_length {self.hidden} is not a multiple of the head count {self.heads}"),
            (self.head_dim % 4 == 0,
             f"head dim {self.head_dim} is not a multiple of 4, which the 2-D rotary (rows, columns) needs"),
            (self.layer_norm_eps > 0, f"clip.vision.attention.layer_norm_epsilon {self.layer_norm_eps} must be > 0"),
            (all(s > 0 for s in self.image_std), f"clip.vision.image_std {self.image_std} must be > 0"),
        )
        for ok, message in checks:
            if not ok:
                raise ModelFormatError(f"{where}: {message}")


def _channel_floats(model: WeightLoader, key: str) -> tuple[float, ...]:
    value = model.get(key)
    if value is None:
        raise ModelFormatError(f"{model.name}: metadata key '{key}' missing")
    if not isinstance(value, GGUFArray) or value.element_type != GGUFValueType.FLOAT32 or len(value) != CHANNELS:
        raise ModelFormatError(f"{model.name}: metadata key '{key}' must be an array of {CHANNELS} FLOAT32")
    return tuple(float(v) for v in value)


# ---------------------------------------------------------------------------------- weights


@dataclass
class Projection:
    """x·Wᵀ + b: a mapped or dense operator and its float32 bias; the result is float32."""

    op: Linear
    bias: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x).to(torch.float32) + self.bias


@dataclass
class LayerNormWeights:
    weight: torch.Tensor
    bias: torch.Tensor


@dataclass
class VisionBlock:
    ln1: LayerNormWeights
    qkv: Projection  # (3·hidden, hidden): q, k, v
    attn_out: Projection
    ln2: LayerNormWeights
    ffn_up: Projection
    ffn_down: Projection


@dataclass
class VisionWeights:
    patch: torch.Tensor  # (hidden, channels·patch²): the two temporal slices summed
    patch_bias: torch.Tensor
    positions: torch.Tensor  # (position_side², hidden), the learned table
    blocks: list[VisionBlock]
    merger_norm: LayerNormWeights  # v.post_ln, per patch before the 2 × 2 concatenation
    merger_up: Projection  # mm.0: (merged_hidden, merged_hidden)
    merger_down: Projection  # mm.2: (out_hidden, merged_hidden)


def load_weights(c: VisionConfig, model: WeightLoader) -> VisionWeights:
    """Every tensor of the tower, shapes checked against `c` (a mismatch names the tensor)."""

    def vec(name: str, n: int) -> torch.Tensor:
        return model.tensor(name, (n,))

    def norm(prefix: str) -> LayerNormWeights:
        return LayerNormWeights(vec(prefix + ".weight", c.hidden), vec(prefix + ".bias", c.hidden))

    def projection(prefix: str, n_in: int, n_out: int) -> Projection:
        return Projection(model.linear(n_in, (prefix + ".weight", n_out)), vec(prefix + ".bias", n_out))

    kernel = (c.hidden, CHANNELS, c.patch_size, c.patch_size)
    # A still image shows the same frame twice, so the Conv3d is exactly a 2-D patch projection
    # with the two temporal slices summed (half the work of the full kernel).
    patch = model.tensor("v.patch_embd.weight", kernel) + model.tensor("v.patch_embd.weight.1", kernel)
    blocks = []
    for i in range(c.depth):
        p = f"v.blk.{i}."
        blocks.append(VisionBlock(
            ln1=norm(p + "ln1"),
            qkv=projection(p + "attn_qkv", c.hidden, 3 * c.hidden),
            attn_out=projection(p + "attn_out", c.hidden, c.hidden),
            ln2=norm(p + "ln2"),
            ffn_up=projection(p + "ffn_up", c.hidden, c.intermediate),
            ffn_down=projection(p + "ffn_down", c.intermediate, c.hidden),
        ))
    return VisionWeights(
        patch=patch.reshape(c.hidden, -1),
        patch_bias=vec("v.patch_embd.bias", c.hidden),
        positions=model.tensor("v.position_embd.weight", (c.position_side**2, c.hidden)),
        blocks=blocks,
        merger_norm=norm("v.post_ln"),
        merger_up=projection("mm.0", c.merged_hidden, c.merged_hidden),
        merger_down=projection("mm.2", c.merged_hidden, c.out_hidden),
    )


# ---------------------------------------------------------------------------------- writer

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
