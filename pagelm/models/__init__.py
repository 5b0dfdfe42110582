"""Model architectures: one module per architecture, pure functions of (weights, inputs, state).

Owns the math of each architecture and its decode state; never parses files (weights arrive
through a `weights.loader.WeightLoader`) and never touches token embeddings or the output head.
"""

# architecture (GGUF general.architecture) -> (module, config class, model class); imported only when used
ARCHITECTURES = {
    "qwen35": ("pagelm.models.qwen35", "Qwen35Config", "Qwen35Model"),
    "llama": ("pagelm.models.llama", "LlamaConfig", "LlamaModel"),
    "gemma3": ("pagelm.models.gemma3", "Gemma3Config", "Gemma3Model"),
}
VISION_ARCHITECTURES = ("qwen35",)  # the models whose image tokens a vision tower (mmproj) makes
# a Hugging Face config.json's model_type -> the architecture
HF_MODEL_TYPES = {
    "qwen3_5": "qwen35", "qwen3_5_text": "qwen35",
    "llama": "llama",
    "gemma3": "gemma3", "gemma3_text": "gemma3",
}


def architecture_module(name: str, where: str):
    """The module of architecture `name` (its config and model classes, its Hugging Face mapping)."""
    import importlib

    from pagelm.errors import UnsupportedError

    if name not in ARCHITECTURES:
        raise UnsupportedError(f"{where}: architecture {name!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return importlib.import_module(ARCHITECTURES[name][0])
