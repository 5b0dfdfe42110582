"""pagelm: a runtime for small language models whose weights stay in the model file."""

__version__ = "0.1.0"

from pagelm.runtime import kernel_cache  # noqa: E402

kernel_cache.configure(__version__)  # before anything imports numba


def load(path: str, embedding: str = "mapped", weights: str = "mapped", dtype: str = "bfloat16",
         device: str = "cpu", threads: int | None = None, mmproj: str | None = None):
    """Open a GGUF model for generation (`pagelm.engine.model.Model`). "mapped" (default) serves token rows
    and computes every layer from the file's quantized bytes; `embedding="dense"` / `weights="dense"`
    unpack the token table / the layer matrices into memory the old way. `threads` (default: the
    CPUs this process may use) sets torch's and the kernels' thread count. `mmproj`: a Qwen3.5
    model's vision tower (default: one found beside the model). `path` may also be a Hugging Face
    Hub name, hf.co/USER/REPO[:QUANT][@REVISION]: used from the Hub's cache, pulled first if needed."""
    from pagelm.engine.load import load_model  # torch loads only when a model does
    from pagelm.sources.hub import locate
    from pagelm.sources.store import hub_name

    if hub_name(path) is not None:
        located = locate(path)
        path, mmproj = str(located.path), mmproj or (str(located.tower) if located.tower else None)
    return load_model(path, embedding=embedding, weights=weights, dtype=dtype, device=device, threads=threads,
                      mmproj=mmproj)
