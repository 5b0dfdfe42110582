"""The architecture registry: every module of pagelm.models that names GGUF architectures is an
architecture (Config, Model, its Hugging Face layout), found by name alone; an architecture file
reads no other architecture's; the registry and weights import no torch / no models."""

import ast
import pathlib
import subprocess
import sys

import pytest

import pagelm.models
from pagelm.errors import UnsupportedError
from pagelm.models import VISION_ARCHITECTURES, architecture_module, hf_layouts

MODELS = pathlib.Path(pagelm.models.__file__).parent
ARCHITECTURES = {"llama": ("llama",), "qwen2": ("qwen2",), "qwen3": ("qwen3",), "qwen3moe": ("qwen3_moe",),
                 "gemma3": ("gemma3", "gemma3_text"),
                 "qwen35": ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), "lfm2": ("lfm2",),
                 "gpt-oss": ("gpt_oss",)}
# each architecture's module name (a GGUF name's '-' is '_' in it)
MODULES = {arch: arch.replace("-", "_") for arch in ARCHITECTURES}


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_architecture_is_found_by_its_names(arch):
    module = architecture_module(arch, "test")
    if arch == "qwen35":  # the Qwen3.5 mixtures of experts are its other GGUF architecture
        assert architecture_module("qwen35moe", "test") is module
    assert module.__name__ == f"pagelm.models.{MODULES[arch]}"
    assert all(hf_layouts(t, "test") is module for t in ARCHITECTURES[arch])
    assert callable(module.Config.from_loader) and callable(module.hf_layout) and hasattr(module.Model, "new_state")


def test_unknown_names_are_refused_with_the_supported_ones():
    with pytest.raises(UnsupportedError, match=r"x.gguf: architecture 'mamba' is not supported \(supported: "
                       r"gemma-embedding, gemma3, gpt-oss, lfm2, llama, qwen2, qwen3, qwen35, qwen35moe, qwen3moe\)"):
        architecture_module("mamba", "x.gguf")
    with pytest.raises(UnsupportedError, match="config.json: model_type 7 is not supported"):
        hf_layouts(7, "config.json")


def test_no_architecture_file_imports_another():
    modules = set(MODULES.values())
    for arch in modules:
        others = {f"pagelm.models.{o}" for o in modules if o != arch}
        assert not _imports(MODELS / f"{arch}.py") & others, arch
    shared = [p for p in MODELS.glob("*.py") if p.stem not in modules]
    for path in shared:  # shared layers serve every architecture and know none
        assert not {i for i in _imports(path) if i.removeprefix("pagelm.models.") in modules}, path.name


def test_weights_modules_import_no_models():
    for path in (MODELS.parent / "weights").glob("*.py"):
        assert not {i for i in _imports(path) if i.startswith("pagelm.models")}, path.name


def test_registry_loads_no_torch():
    code = "import sys, pagelm.models as m; print(m.VISION_ARCHITECTURES, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{VISION_ARCHITECTURES} False"
    assert all(architecture_module(a, "test") for a in VISION_ARCHITECTURES)
