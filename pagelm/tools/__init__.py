"""Tools over model files: synthetic models with real geometries (`synth`, each architecture's part
in `synth_arch`, the shapes in `synth_shapes`) and Qwen3.5 vision towers (`synth_tower`), GGUF to
Hugging Face / FastFlowLM directories (`convert`), mapped rows checked against dense tables and
gguf.quants (`verify`); the `synth` and `verify-embeddings` commands.

Owns no part of generation; everything here writes or checks files.
"""
