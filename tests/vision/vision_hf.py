"""transformers' Qwen3.5 vision tower and image processor for the tests, and llama.cpp's converter
naming between its state dict and an mmproj GGUF (both ways; GGUF files are read back with
gguf-py, not with pagelm's reader)."""

from __future__ import annotations

import math

import gguf
import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionConfig, Qwen3_5VisionModel

from pagelm.vision.mmproj import VisionConfig

# transformers name -> llama.cpp name (conversion/qwen3vl.py and gguf-py's tensor map); the
# patch kernel is split along its temporal axis into two tensors, handled apart.
_BLOCK_NAMES = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
                "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_TOP_NAMES = {"patch_embed.proj.bias": "v.patch_embd.bias", "pos_embed.weight": "v.position_embd.weight",
              "merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2"}
_PATCH = "patch_embed.proj.weight"
_SLICES = ("v.patch_embd.weight", "v.patch_embd.weight.1")


def hf_config(c: VisionConfig) -> Qwen3_5VisionConfig:
    return Qwen3_5VisionConfig(depth=c.depth, hidden_size=c.hidden, num_heads=c.heads,
                               intermediate_size=c.intermediate, out_hidden_size=c.out_hidden,
                               patch_size=c.patch_size, spatial_merge_size=c.merge_size, temporal_patch_size=2,
                               num_position_embeddings=c.position_side**2)


def gguf_name(hf: str) -> str:
    if hf in _TOP_NAMES:
        return _TOP_NAMES[hf]
    stem, suffix = hf.rsplit(".", 1)
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    _, block, rest = stem.split(".", 2)  # blocks.N.<module>
    return f"v.blk.{block}.{_BLOCK_NAMES[rest]}.{suffix}"


def hf_to_gguf(model: Qwen3_5VisionModel) -> dict[str, np.ndarray]:
    """The tower's tensors under llama.cpp's names, numpy order, float32."""
    out = {}
    for name, value in model.state_dict().items():
        value = value.detach().float().numpy()
        if name == _PATCH:
            out[_SLICES[0]], out[_SLICES[1]] = value[:, :, 0], value[:, :, 1]
        else:
            out[gguf_name(name)] = value
    return out


def gguf_to_hf(path: str, model: Qwen3_5VisionModel) -> None:
    """Load an mmproj file's tensors (read by gguf-py) into `model`."""
    reader = gguf.GGUFReader(path, "c")  # copy-on-write: arrays torch may wrap (then copied to float32)
    tensors = {t.name: torch.from_numpy(t.data).to(torch.float32, copy=True) for t in reader.tensors}
    state = {}
    for name in model.state_dict():
        state[name] = (torch.stack([tensors[s] for s in _SLICES], dim=2) if name == _PATCH
                       else tensors[gguf_name(name)])
    model.load_state_dict(state, strict=True, assign=True)


def random_hf_model(c: VisionConfig, seed: int) -> Qwen3_5VisionModel:
    """A transformers tower with values of healthy scales (its own init is near zero): weights
    N(0, 1/fan_in), LayerNorms 1 + noise, biases and positions noise; every matrix and the
    position table rounded to float16, so that an F16 file holds them exactly."""
    torch.manual_seed(seed)
    model = Qwen3_5VisionModel(hf_config(c)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.05)
            elif "norm" in name:
                p.normal_(1.0, 0.05)
            elif name == "pos_embed.weight":
                p.normal_(0.0, 0.5).copy_(p.half().float())
            else:
                p.normal_(0.0, 1 / math.sqrt(p[0].numel())).copy_(p.half().float())
    return model


def hf_encode(model: Qwen3_5VisionModel, rows: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(np.ascontiguousarray(rows)), torch.tensor([grid])).pooler_output.numpy()


def hf_processor(min_tokens: int, max_tokens: int) -> Qwen2VLImageProcessorPil:
    """Qwen3.5's image processor (preprocessor_config.json) with token bounds as pixel bounds."""
    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, size={"shortest_edge": min_tokens * 1024,
                                                            "longest_edge": max_tokens * 1024})
