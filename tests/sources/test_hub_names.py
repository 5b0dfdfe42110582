"""Hub names and the choice of files in a repository, on the file lists of real repositories
(unsloth/Qwen3.5-0.8B-GGUF, ggml-org/Qwen3.5-0.8B-GGUF) and made-up ones."""

import re

import pytest

from pagelm.sources.hub import HubError, HubName, choose_model, choose_tower, parse_name, quant_label

UNSLOTH = ["Qwen3.5-0.8B-Q4_K_M.gguf", "Qwen3.5-0.8B-Q8_0.gguf", "Qwen3.5-0.8B-UD-Q4_K_XL.gguf",
           "Qwen3.5-0.8B-BF16.gguf", "mmproj-F16.gguf", "mmproj-BF16.gguf", "imatrix_unsloth.gguf_file",
           "README.md", ".gitattributes"]
GGML_ORG = ["Qwen3.5-0.8B-Q4_0.gguf", "Qwen3.5-0.8B-Q8_0.gguf", "Qwen3.5-0.8B-BF16.gguf",
            "mmproj-Qwen3.5-0.8B-BF16.gguf", "README.md"]


@pytest.mark.parametrize("text, expected", [
    ("hf.co/unsloth/Qwen3.5-0.8B-GGUF:Q8_0", HubName("unsloth/Qwen3.5-0.8B-GGUF", "Q8_0")),
    ("hf://unsloth/Qwen3.5-0.8B-GGUF", HubName("unsloth/Qwen3.5-0.8B-GGUF")),
    ("huggingface.co/a/b@v1.0", HubName("a/b", None, "v1.0")),
    ("a/b:UD-Q4_K_XL@0123abc", HubName("a/b", "UD-Q4_K_XL", "0123abc")),
    ("a/b", None), ("models/x.gguf", None), ("Why is the sky blue?", None), ("What is 1/2: a half?", None),
])
def test_names(text, expected):
    assert parse_name(text) == expected


@pytest.mark.parametrize("text", ["hf.co/a", "hf.co/a/b:", "hf.co/a/b@", "hf.co/a/b/c", "hf.co/a/b:Q8_0:x", "hf.co/a/b@../../x",
                                  "a/b:Q8_0@main branch"])
def test_malformed_hub_names_are_errors(text):
    with pytest.raises(HubError, match="not a Hub model name"):
        parse_name(text)


@pytest.mark.parametrize("repo", ["a--b/c", "a/b..", "a/b-", "a/.b", "-a/b", "a/b.git", "a/" + "b" * 97])
def test_repository_names_the_hub_refuses_are_errors_naming_them(repo):
    with pytest.raises(HubError, match=f"'{re.escape(repo)}' is not a repository name the Hub allows"):
        parse_name(f"hf.co/{repo}:Q8_0")
    with pytest.raises(HubError, match=f"'{re.escape(repo)}' is not a repository name the Hub allows"):
        parse_name(f"{repo}:Q8_0")


def test_quant_labels():
    assert [quant_label(f) for f in UNSLOTH[:4]] == ["Q4_K_M", "Q8_0", "UD-Q4_K_XL", "BF16"]
    assert quant_label("BF16/Qwen3.5-9B-BF16-00001-of-00002.gguf") == "BF16"
    assert quant_label("model.gguf") == "model.gguf"


def test_model_choice():
    def chosen(files, quant=None):
        return choose_model(files, HubName("u/r", quant))

    assert chosen(UNSLOTH) == ["Qwen3.5-0.8B-Q4_K_M.gguf"]  # the default
    assert chosen(GGML_ORG) == ["Qwen3.5-0.8B-Q8_0.gguf"]  # no Q4_K_M: Q8_0
    assert chosen(["only-IQ2_XS.gguf", "mmproj-F16.gguf"]) == ["only-IQ2_XS.gguf"]  # the only model
    assert chosen(UNSLOTH, "ud-q4_k_xl") == ["Qwen3.5-0.8B-UD-Q4_K_XL.gguf"]
    assert chosen(UNSLOTH, "Qwen3.5-0.8B-BF16.gguf") == ["Qwen3.5-0.8B-BF16.gguf"]
    split = ["BF16/m-BF16-00002-of-00002.gguf", "BF16/m-BF16-00001-of-00002.gguf", "m-Q8_0.gguf"]
    assert chosen(split, "BF16") == ["BF16/m-BF16-00001-of-00002.gguf", "BF16/m-BF16-00002-of-00002.gguf"]
    with pytest.raises(HubError, match="has no quant 'Q5_K_M'; it has: BF16, Q4_K_M, Q8_0, UD-Q4_K_XL"):
        chosen(UNSLOTH, "Q5_K_M")
    with pytest.raises(HubError, match="several models and no Q4_K_M or Q8_0"):
        chosen(["a-Q4_0.gguf", "a-Q5_0.gguf"])
    with pytest.raises(HubError, match="without its part"):
        chosen(split[1:], "BF16")


def test_checkpoint_repositories_take_only_what_a_model_needs():
    files = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "generation_config.json", "README.md", "original/consolidated.00.pth", "onnx/model.onnx"]
    assert choose_model(files, HubName("u/r")) == sorted(files[:8])
    with pytest.raises(HubError, match="no GGUF model and no safetensors checkpoint"):
        choose_model(["README.md", "pytorch_model.bin", "config.json"], HubName("u/r"))


def test_tower_choice():
    assert choose_tower(UNSLOTH, "Qwen3.5-0.8B-Q8_0.gguf") == "mmproj-F16.gguf"
    assert choose_tower(UNSLOTH, "Qwen3.5-0.8B-BF16.gguf") == "mmproj-BF16.gguf"  # the model's own precision
    assert choose_tower(UNSLOTH, "Qwen3.5-0.8B-Q8_0.gguf", "bf16") == "mmproj-BF16.gguf"
    assert choose_tower(GGML_ORG, "Qwen3.5-0.8B-Q8_0.gguf") == "mmproj-Qwen3.5-0.8B-BF16.gguf"  # the only one
    assert choose_tower(["BF16/m-BF16.gguf", "mmproj-F16.gguf"], "BF16/m-BF16.gguf") == "mmproj-F16.gguf"  # root
    assert choose_tower(["m-Q8_0.gguf"], "m-Q8_0.gguf") is None
    with pytest.raises(HubError, match="no such vision tower"):
        choose_tower(UNSLOTH, "Qwen3.5-0.8B-Q8_0.gguf", "F32")
