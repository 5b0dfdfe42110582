"""Qwen3.5-MoE text decoder (llama.cpp's `qwen35moe` architecture: Qwen3.5-35B-A3B): the Qwen3.5 hybrid
(Gated DeltaNet and gated attention, `models.qwen35`) with a mixture of experts as every layer's
feed-forward: a softmax router, the top-k experts (expert_used_count of expert_count) always renormalized
(as transformers and llama.cpp do; no expert_weights_norm is read), each a SiLU-gated MLP, plus a shared
expert (expert_shared_feed_forward_length wide) scaled by the sigmoid of its gate, ffn_gate_inp_shexp.

Owns only what sets qwen35moe apart: its config fields, its feed-forward's loading and its Hugging Face
names; the hybrid's math and state are `models.qwen35`'s, the experts' `models.moe`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pagelm.errors import ModelFormatError
from pagelm.models import qwen35
from pagelm.models.llama_family import expert_names, load_experts, moe_metadata
from pagelm.models.moe import Experts
from pagelm.weights.hf import HFConfig, HFLayout
from pagelm.weights.loader import WeightLoader

ARCH = "qwen35moe"
GGUF_ARCHITECTURES = (ARCH,)  # the registry's names (pagelm.models)
HF_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class Qwen35MoeConfig(qwen35.Qwen35Config):
    ARCH: ClassVar[str] = ARCH

    # (ffn: a dense feed-forward's width, 0 unless a file gives feed_forward_length; no layer has one)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # the shared expert's width

    expert_norm: ClassVar[bool] = True  # the top-k weights renormalized (load_experts reads it)

    @classmethod
    def _feed_forward(cls, model: WeightLoader, i) -> dict[str, Any]:
        dense = f"{ARCH}.feed_forward_length"
        return {"ffn": i("feed_forward_length") if model.has(dense) else 0, "n_experts": i("expert_count"),
                "n_experts_used": i("expert_used_count"), "expert_ffn": i("expert_feed_forward_length"),
                "shared_ffn": i("expert_shared_feed_forward_length")}

    def _not_counts(self) -> tuple[str, ...]:
        return (*super()._not_counts(), "ffn")

    def validate(self, where: str | None = None) -> None:
        super().validate(where)
        if self.n_experts_used > self.n_experts:
            raise ModelFormatError(f"{where or f'{ARCH} config'}: expert_used_count {self.n_experts_used} "
                                   f"exceeds expert_count {self.n_experts}")


def load_mlp(c: Qwen35MoeConfig, model: WeightLoader, p: str) -> Experts:
    return load_experts(c, model, p, c.shared_ffn)


class Qwen35MoeModel(qwen35.Qwen35Model):
    """Qwen35Model whose layers' feed-forward is a mixture of experts with a shared expert
    (`models.moe.Experts`, each layer's `mlp`); the experts stay in the file."""

    load_mlp = staticmethod(load_mlp)


def hf_layout(config: HFConfig, hf_names: set[str] | None) -> HFLayout:
    """A Hugging Face Qwen3.5-MoE checkpoint in GGUF terms: qwen35's, each layer's feed-forward its
    router, its experts one tensor each (mlp.experts.E.{gate,up,down}_proj) and its shared expert."""
    metadata = moe_metadata(ARCH, config, hf_names)
    del metadata[f"{ARCH}.expert_weights_norm"]  # Qwen3.5-MoE always renormalizes; norm_topk_prob is not read
    metadata[f"{ARCH}.expert_shared_feed_forward_length"] = config.int("shared_expert_intermediate_size")
    feed_forward = {**expert_names(metadata[f"{ARCH}.expert_count"]),
                    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                    **{f"ffn_{x}_shexp.weight": f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}}
    layout = qwen35.hf_layout(config, hf_names, ARCH, feed_forward)
    layout.metadata.update(metadata)
    for name, tmap in layout.tensors.items():  # llama.cpp's gate is a vector, transformers' a one-row matrix
        if name.endswith("ffn_gate_inp_shexp.weight"):
            layout.tensors[name] = replace(tmap, hf_shape=(1, config.int("hidden_size")))
    return layout


def hf_config(c: Qwen35MoeConfig, tied: bool) -> dict:
    """config.json for a Hugging Face twin of a checkpoint with this config (Qwen3_5MoeForCausalLM's)."""
    config = qwen35.hf_config(c, tied)
    if not c.ffn:
        del config["intermediate_size"]
    return {**config, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            "num_experts": c.n_experts, "num_experts_per_tok": c.n_experts_used,
            "moe_intermediate_size": c.expert_ffn, "shared_expert_intermediate_size": c.shared_ffn}


Config, Model = Qwen35MoeConfig, Qwen35MoeModel  # the registry's names (pagelm.models)
