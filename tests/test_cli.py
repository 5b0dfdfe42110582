"""The `pagelm` command line, run as a real process and in-process where a fault is injected."""

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from pagelm import cli
from pagelm.weights import MappedRows


def _pagelm(*args, check=True):
    result = subprocess.run([sys.executable, "-m", "pagelm", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(result.stderr)
    return result


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("models") / "tiny.gguf")
    _pagelm("synth", "--shape", "tiny", "--embedding-only", "--seed", "3", path)
    return path


def test_help_explains_every_command():
    out = _pagelm("--help").stdout
    for command in ("synth", "verify-embeddings", "mem"):
        assert command in out
    assert "rows: <N> checked, <D> differing" in _pagelm("verify-embeddings", "--help").stdout


def test_synth_writes_the_shape_gguf_py_can_read(tiny_model):
    reader = gguf.GGUFReader(tiny_model)
    (tensor,) = reader.tensors
    assert tensor.name == "token_embd.weight"
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(tensor.shape) == [256, 4096]
    assert not os.path.exists(tiny_model + ".part")


def test_synth_is_seeded(tmp_path, tiny_model):
    again = str(tmp_path / "again.gguf")
    other = str(tmp_path / "other.gguf")
    _pagelm("synth", "--shape", "tiny", "--embedding-only", "--seed", "3", "--quiet", again)
    _pagelm("synth", "--shape", "tiny", "--embedding-only", "--seed", "4", "--quiet", other)
    original = open(tiny_model, "rb").read()
    assert open(again, "rb").read() == original
    assert open(other, "rb").read() != original


def test_synth_without_embedding_only_says_why():
    result = _pagelm("synth", "--shape", "tiny", "x.gguf", check=False)
    assert result.returncode == 2 and "--embedding-only" in result.stderr
    assert not os.path.exists("x.gguf")


def test_synth_mmproj_writes_the_tower_alone(tmp_path):
    from dataclasses import replace

    from pagelm.tools.synth_tower import SHAPES
    from pagelm.vision import VisionConfig
    from pagelm.weights.loader import WeightLoader

    path = str(tmp_path / "mmproj.gguf")
    result = _pagelm("synth", "--shape", "qwen3.5-tiny-chat", "--mmproj", path, "--seed", "2", "--quiet")
    assert "vision tower" in result.stdout and result.stderr == ""
    read = VisionConfig.from_loader(WeightLoader.open(path))
    assert replace(read, layer_norm_eps=1e-6) == SHAPES["qwen3.5-tiny-chat"]  # eps is stored as float32
    assert gguf.GGUFReader(path).fields["pagelm.synthetic.seed"].contents() == 2
    assert sorted(os.listdir(tmp_path)) == ["mmproj.gguf"]
    refused = _pagelm("synth", "--shape", "tiny", "--mmproj", str(tmp_path / "x.gguf"), check=False)
    assert refused.returncode == 2 and "has no vision tower" in refused.stderr
    nothing = _pagelm("synth", "--shape", "qwen3.5-tiny", check=False)
    assert nothing.returncode == 2 and "--mmproj" in nothing.stderr


def test_verify_embeddings_passes_on_a_synthetic_model(tiny_model):
    result = _pagelm("verify-embeddings", tiny_model, "--json")
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "rows: 4096 checked, 0 differing"
    report = json.loads(lines[-2])
    assert report["rows_checked"] == 4096 and report["oracle_checked"] == 4096
    assert report["oracle"].startswith("gguf ")


def test_verify_embeddings_rows_option(tmp_path):
    path = str(tmp_path / "q6k.gguf")
    _pagelm("synth", "--shape", "tiny", "--embedding-only", "--embedding-type", "Q6_K", "--quiet", path)
    lines = _pagelm("verify-embeddings", path, "--rows", "100").stdout.strip().splitlines()
    assert "Q6_K" in lines[0]
    assert lines[-1] == "rows: 100 checked, 0 differing"


def test_verify_embeddings_fails_when_a_row_differs(tiny_model, monkeypatch, capsys):
    honest = MappedRows.lookup

    def one_bit_off(self, ids):
        rows = honest(self, ids).copy()
        rows[np.asarray(ids) == 1234, 0] ^= 1
        return rows

    monkeypatch.setattr(MappedRows, "lookup", one_bit_off)
    assert cli.main(["verify-embeddings", tiny_model]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "rows: 4096 checked, 1 differing"


def test_bad_model_files_get_a_clear_error(tmp_path, tiny_model):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(tiny_model, "rb").read()[:5000])
    for path in (str(truncated), str(tmp_path / "missing.gguf")):
        result = _pagelm("verify-embeddings", path, check=False)
        assert result.returncode == 2
        assert result.stderr.startswith("pagelm: error:") and os.path.basename(path) in result.stderr
        assert "Traceback" not in result.stderr


def test_mem_reports_this_process_as_json():
    figures = json.loads(_pagelm("mem", "--json").stdout)
    assert figures["anonymous_mib"] > 0 and figures["peak_rss_mib"] >= figures["rss_mib"]
    assert "file rss" in _pagelm("mem").stdout


def test_real_qwen35_0_8b_geometry_verifies_every_row(tmp_path):
    path = str(tmp_path / "qwen3.5-0.8b.gguf")
    _pagelm("synth", "--shape", "qwen3.5-0.8b", "--embedding-only", "--quiet", path)
    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == ["token_embd.weight"]  # tied: no output.weight
    assert list(reader.tensors[0].shape) == [1024, 248320]
    assert _pagelm("verify-embeddings", path).stdout.strip().splitlines()[-1] == "rows: 248320 checked, 0 differing"


def test_synth_format_hf_writes_the_same_model_as_a_directory(tmp_path):
    """The same seed in both containers, matrices in BF16 so both hold the same numbers: the
    same logits, and pull PATH / list / run / rm work on the directory."""
    gguf, directory = str(tmp_path / "m.gguf"), str(tmp_path / "m-hf")
    common = ["--shape", "qwen3.5-tiny-chat", "--layer-type", "BF16", "--embedding-type", "BF16", "--quiet"]
    _pagelm("synth", *common, gguf)
    out = _pagelm("synth", *common, "--format", "hf", directory).stdout
    assert "as a Hugging Face directory" in out
    assert sorted(os.listdir(directory)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                             "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert not os.path.exists(directory + ".gguf.part")
    from pagelm.engine.load import load_model

    ids = list(range(100, 140))
    a, b = load_model(gguf).session(64).prefill(ids), load_model(directory).session(64).prefill(ids)
    assert np.array_equal(a, b)
    env = {**os.environ, "PAGELM_HOME": str(tmp_path / "home")}
    run = lambda *args: subprocess.run([sys.executable, "-m", "pagelm", *args], capture_output=True, text=True, env=env)
    assert "m-hf: " in run("pull", directory).stdout
    assert "(local)" in run("list").stdout
    answer = run("run", "m-hf", "Hello", "--max-tokens", "4", "--json")
    assert answer.returncode == 0, answer.stderr
    assert "forgot m-hf" in run("rm", "m-hf").stdout and os.path.isdir(directory)


def test_synth_format_hf_of_a_model_without_a_vocabulary(tmp_path):
    out = _pagelm("synth", "--shape", "qwen3.5-tiny", "--format", "hf", "--quiet", str(tmp_path / "ids")).stdout
    assert out.count("wrote ") == 1  # the staging GGUF's own line is not shown
    assert sorted(os.listdir(tmp_path / "ids")) == ["config.json", "generation_config.json", "model.safetensors"]


def test_cluster_flags_need_replicas(tiny_model):
    for flag in (["--ray-address", "127.0.0.1:6379"], ["--replica-niceness", "5"]):
        result = _pagelm("serve", tiny_model, *flag, check=False)
        assert result.returncode != 0 and f"{flag[0]} needs --replicas N" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
