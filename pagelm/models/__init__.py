"""Model architectures: one module per architecture, pure functions of (weights, inputs, state).

Owns the math of each architecture and its decode state; never parses files (weights arrive
through `models.loading`) and never touches token embeddings or the output head.
"""

# GGUF `general.architecture` -> the module implementing it (imported on demand: torch is heavy).
ARCHITECTURES = {"qwen35": "pagelm.models.qwen35"}
