"""llama.cpp's embedding mode in a process of its own, for `pagelm bench embed` (a failed assertion in
llama.cpp aborts the process it runs in): `python -m pagelm.bench.llama_embed MODEL THREADS` loads
MODEL, says {"loaded": dimensions} on a line of stdout, then answers each line of stdin
({"inputs": [[token ids], ...]}) with a line {"seconds": s, "vectors": [[...], ...]} (the seconds of
llama.cpp's decode alone), or {"error": "..."}.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from pagelm.bench.batch import load_llama_cpp_model


class LlamaCppEmbedder:
    """llama.cpp's embedding mode over one file (llama-cpp-python's low-level API): the inputs of a
    call decoded as one llama_batch, one sequence each, pooled as the file says; a context per shape
    of call, kept for the next."""

    def __init__(self, path: str, threads: int):
        from llama_cpp import llama_cpp as c

        self.c, self.threads = c, threads
        self.model = load_llama_cpp_model(path)
        self.dimensions = c.llama_model_n_embd_out(self.model)
        self._contexts: dict[tuple[int, int], tuple] = {}  # (inputs, tokens) -> (context, batch)

    def _context(self, count: int, total: int) -> tuple:
        c = self.c
        if (count, total) not in self._contexts:
            params = c.llama_context_default_params()
            params.embeddings = True
            params.n_ctx = params.n_batch = params.n_ubatch = total  # an encoder takes a batch in one ubatch
            params.n_seq_max = count
            params.n_threads = params.n_threads_batch = self.threads
            context = c.llama_init_from_model(self.model, params)
            if not context:
                raise RuntimeError(f"llama.cpp could not make a context of {count} sequences, {total} tokens")
            self._contexts[count, total] = (context, c.llama_batch_init(total, 0, count))
        return self._contexts[count, total]

    def embed_all(self, inputs: list[list[int]]) -> np.ndarray:
        c = self.c
        context, batch = self._context(len(inputs), sum(len(ids) for ids in inputs))
        k = 0
        for seq, ids in enumerate(inputs):
            for pos, token in enumerate(ids):
                batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = token, pos, 1, True
                batch.seq_id[k][0] = seq
                k += 1
        batch.n_tokens = k
        c.llama_memory_clear(c.llama_get_memory(context), True)
        if c.llama_decode(context, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.stack([np.ctypeslib.as_array(c.llama_get_embeddings_seq(context, seq), shape=(self.dimensions,))
                         for seq in range(len(inputs))]).copy()

    def close(self) -> None:
        for context, batch in self._contexts.values():
            self.c.llama_batch_free(batch)
            self.c.llama_free(context)
        self.c.llama_model_free(self.model)


def main(path: str, threads: int) -> None:
    try:
        llama = LlamaCppEmbedder(path, threads)
    except Exception as e:  # noqa: BLE001 - told to the benchmark, which goes on without llama.cpp
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(json.dumps({"loaded": llama.dimensions}), flush=True)
    try:
        for line in sys.stdin:
            inputs = json.loads(line)["inputs"]
            try:
                start = time.perf_counter()
                vectors = llama.embed_all(inputs)
                reply = {"seconds": time.perf_counter() - start, "vectors": vectors.tolist()}
            except Exception as e:  # noqa: BLE001 - as above
                reply = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(reply), flush=True)
    finally:
        llama.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
