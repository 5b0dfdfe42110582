"""pagelm: a runtime for small language models whose weights stay in the model file."""

__version__ = "0.1.0"


def load(path: str, embedding: str = "mapped", dtype: str = "bfloat16", device: str = "cpu"):
    """Open a GGUF model for generation (`pagelm.engine.Model`). `embedding="dense"` unpacks the
    token table into memory the old way; "mapped" (default) serves rows from the file."""
    from pagelm.engine import Model  # torch loads only when a model does

    return Model(path, embedding=embedding, dtype=dtype, device=device)
