"""Qwen3.5's vision tower as llama.cpp ships it: an "mmproj" GGUF (`general.architecture = clip`,
`clip.projector_type = qwen3vl_merger`) beside the language model.

Owns the file's keys and tensor names: `VisionConfig` read from them, the tower's weights taken
through a `WeightLoader` (matrices as operators in the loader's weights mode, small tensors as
float32). Never computes a forward pass (`vision.tower` does) and never writes one (`tools.synth_tower`
does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.gguf import GGUFArray, GGUFValueType
from pagelm.weights.linear import Linear
from pagelm.weights.loader import WeightLoader

ARCH = "clip"
PROJECTOR = "qwen3vl_merger"
CHANNELS = 3
# A still image is the same frame twice: the Conv3d's kernel spans 2 frames, stored as two slices
# (`v.patch_embd.weight` and `v.patch_embd.weight.1`).
TEMPORAL_PATCH = 2


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
