"""Replacing a model under a live server, the way `pagelm pull` and `synth` write (NAME.part, then
a rename over the old name): the running server keeps answering from the file it mapped, with no
bus error and no mixed weights; a restart serves the new one. For a GGUF file and for a file
inside a Hugging Face directory."""

import os
import shutil

import httpx
import numpy as np
from serve_helpers import ServerProcess

from pagelm.formats.safetensors import SafetensorsFile, TensorToWrite, write_safetensors
from pagelm.models import architecture_module
from pagelm.weights.writer import write_directory


def _answer(server: ServerProcess) -> str:
    r = httpx.post(f"{server.url}/api/generate", timeout=120, json={
        "model": server.model, "prompt": "The capital of France is", "stream": False,
        "options": {"num_predict": 12, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["response"]


def _serve(path) -> ServerProcess:
    # no prefix cache: every answer is computed again from the mapped weights
    return ServerProcess(str(path), "--ctx-len", "256", "--prefix-slots", "0").wait_ready()


def _replaced_under_a_live_server(path, replace) -> None:
    server = _serve(path)
    try:
        before = _answer(server)
        replace()
        assert _answer(server) == before
        assert server.proc.poll() is None
    finally:
        server.stop()
    restarted = _serve(path)
    try:
        assert _answer(restarted) != before
    finally:
        restarted.stop()


def test_a_gguf_renamed_over_the_served_one(tmp_path, smollm2_gguf, gemma3_gguf):
    path = tmp_path / "model.gguf"
    shutil.copy(smollm2_gguf, path)

    def replace():
        shutil.copy(gemma3_gguf, str(path) + ".part")
        os.replace(str(path) + ".part", path)

    _replaced_under_a_live_server(path, replace)


def test_a_safetensors_file_renamed_over_the_served_one(tmp_path, smollm2_gguf):
    directory = tmp_path / "smollm2-hf"
    write_directory(smollm2_gguf, str(directory), "hf", quantized="bf16", architectures=architecture_module)
    weights = directory / "model.safetensors"

    def replace():
        with SafetensorsFile.open(weights) as f:
            def values(name):
                v = np.array(f.tensor(name))
                # other weights of the same shapes: the embedding rows of the even tokens swapped
                return v[np.arange(len(v)) ^ 1] if name.endswith("embed_tokens.weight") else v
            tensors = [TensorToWrite(n, f.tensors[n].dtype, f.tensors[n].shape, lambda n=n: values(n)) for n in f.tensors]
            write_safetensors(str(weights), tensors)  # to model.safetensors.part, then renamed

    _replaced_under_a_live_server(directory, replace)
