"""Models from the Hugging Face Hub: names (hf.co/USER/REPO[:QUANT][@REVISION]), which files of a
repository make the model and its vision tower, and downloads into huggingface_hub's own cache.

huggingface_hub lists repositories (sizes, LFS sha256, revisions, tokens, HF_ENDPOINT, HF_HUB_OFFLINE);
the bytes are fetched here, because it neither resumes a download nor checks its sha256: each file
goes to blobs/ETAG.incomplete (HTTP Range resumes it, across processes), retried with backoff, and is
renamed into place only once its hash matches the listing's.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from pagelm.errors import PagelmError
from pagelm.formats.gguf import GGUFFile
from pagelm.formats.safetensors import read_json_file
from pagelm.models import VISION_ARCHITECTURES
from pagelm.sources import records
from pagelm.sources.home import home

_PREFIXES = ("hf.co/", "huggingface.co/", "https://huggingface.co/", "hf://")
CONFIG_LIMIT = 1 << 20  # a directory's config.json, read for its model_type
_REPO_SHAPE = re.compile(r"[\w.-]+/[\w.-]+")  # what is meant as USER/REPO; _REPO_PART says whether the Hub allows it
# as huggingface_hub's validate_repo_id (the Hub's own rule): 1 to 96 letters, digits, '_', '-', '.', starting
# and ending with a letter, digit or '_', no '--' or '..' anywhere, not ending in .git
_REPO_PART = re.compile(r"(?!.*(--|\.\.))(?!.*\.git$)[A-Za-z0-9_]([A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")
REPO_RULE = ("USER/REPO, each 1 to 96 letters, digits, '_', '-' or '.', no '--' or '..', not starting or ending "
             "with '-' or '.', not ending in .git")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REVISION = re.compile(r"[\w.-]+(/[\w.-]+)*")  # a branch, tag or commit (it names a file under refs/)
NAME_FORMS = "hf.co/USER/REPO[:QUANT][@REVISION], hf://USER/REPO[:QUANT] or USER/REPO:QUANT"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # no QUANT: the first of these the repository has, else its only model
_NOT_MODELS = ("mmproj", "imatrix", "mtp-")  # GGUFs in model repositories that are not the model
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT_LABEL = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|F16|F32))"
    r"(?:-\d{5}-of-\d{5})?\.gguf$", re.IGNORECASE)
TOWER_PRECISIONS = ("F16", "BF16", "F32")  # a tower's precision, preferred in this order after the model's own
# what a safetensors checkpoint directory needs (pagelm.weights.hf), nothing else of the repository
_CHECKPOINT_FILE = re.compile(
    r"config\.json|generation_config\.json|[^/]*\.safetensors|[^/]*\.safetensors\.index\.json|tokenizer\.json|"
    r"tokenizer_config\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|"
    r"chat_template\.jinja|chat_template\.json|preprocessor_config\.json|mmproj\.gguf")
CHUNK = 1 << 20
RETRIES = 5  # failed attempts in a row (without new bytes) before a download gives up
BACKOFF_S = 1.0  # the first retry's wait; doubled each time, at most MAX_BACKOFF_S
MAX_BACKOFF_S = 30.0
OnBytes = Callable[[Path, int, int], None]  # (the partial file, bytes in it, the file's size): a download grew


class HubError(PagelmError):
    """A Hub name, repository or download that cannot be used; the command exits with status 1."""

    exit_status = 1


@dataclass(frozen=True)
class HubName:
    repo: str
    quant: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        return f"hf.co/{self.repo}" + (f":{self.quant}" if self.quant else "") + \
            (f"@{self.revision}" if self.revision else "")


def parse_name(text: str) -> HubName | None:
    """The Hub model `text` names, or None when it is not a Hub name. A bare USER/REPO (no prefix)
    is a Hub name only with :QUANT, so that relative paths stay paths."""
    prefix = next((p for p in _PREFIXES if text.lower().startswith(p)), None)
    rest = text[len(prefix):] if prefix else text
    rest, at, revision = rest.partition("@")
    repo, colon, quant = rest.partition(":")
    if prefix is None and not (colon and _REPO_SHAPE.fullmatch(repo)):
        return None
    bad_revision = at and (not _REVISION.fullmatch(revision) or ".." in revision)
    if not _REPO_SHAPE.fullmatch(repo) or (colon and not quant) or bad_revision or ":" in quant:
        raise HubError(f"{text}: not a Hub model name ({NAME_FORMS})")
    if not all(_REPO_PART.fullmatch(part) for part in repo.split("/")):
        raise HubError(f"{text}: '{repo}' is not a repository name the Hub allows ({REPO_RULE})")
    return HubName(repo, quant or None, revision or None)


def quant_label(path: str) -> str:
    """The quantization a GGUF's name carries (Q4_K_M, UD-Q4_K_XL, BF16, ...), else its file name."""
    match = _QUANT_LABEL.search(PurePosixPath(path).name)
    return match.group(1).upper() if match else PurePosixPath(path).name


def _split_parts(path: str, files: list[str]) -> list[str]:
    """All parts of a split GGUF (`-00001-of-0000N.gguf`) in order, or just `path`."""
    match = _SPLIT.search(path)
    if match is None:
        return [path]
    count = int(match.group(2))
    parts = [path[:match.start()] + f"-{i:05d}-of-{match.group(2)}.gguf" for i in range(1, count + 1)]
    present = {f.lower(): f for f in files}
    missing = [p for p in parts if p.lower() not in present]
    if missing:
        raise HubError(f"{path}: split GGUF without its part(s) {', '.join(missing)}")
    return [present[p.lower()] for p in parts]


def _model_ggufs(files: list[str]) -> list[str]:
    """Model GGUFs (a split one by its first part), never a tower, an imatrix or an MTP head."""
    return sorted(f for f in files if f.lower().endswith(".gguf")
                  and not any(word in PurePosixPath(f).name.lower() for word in _NOT_MODELS)
                  and (_SPLIT.search(f) is None or _SPLIT.search(f).group(1) == "00001"))


def _matching(candidates: list[str], wanted: str, what: str, where: str) -> str | None:
    """The one candidate `wanted` names: its quant label or its file name (case-insensitively),
    else llama.cpp's rule (`WANTED-` or `WANTED.` in the name); None when none does."""
    lowered = wanted.lower()
    for rule in (lambda f: quant_label(f).lower() == lowered,
                 lambda f: PurePosixPath(f).name.lower() == lowered or f.lower() == lowered,
                 lambda f: re.search(rf"(?<![a-z0-9]){re.escape(lowered)}[-.]", PurePosixPath(f).name.lower())):
        found = [f for f in candidates if rule(f)]
        if len(found) > 1:
            raise HubError(f"{where}: '{wanted}' matches several {what}s ({', '.join(found)}); give the whole file name")
        if found:
            return found[0]
    return None


def choose_model(files: list[str], name: HubName) -> list[str]:
    """The repository files that make the model `name` asks for: a GGUF (all parts of a split one)
    or, in a repository without GGUFs, a safetensors checkpoint's files; HubError lists the quants."""
    models = _model_ggufs(files)
    if not models:
        checkpoint = sorted(f for f in files if _CHECKPOINT_FILE.fullmatch(f))
        if "config.json" in checkpoint and any(f.endswith(".safetensors") for f in checkpoint):
            if name.quant:
                raise HubError(f"{name}: {name.repo} holds a safetensors checkpoint, no GGUF quants; "
                               f"pull hf.co/{name.repo} without :{name.quant}")
            return checkpoint
        raise HubError(f"{name}: {name.repo} holds no GGUF model and no safetensors checkpoint (config.json + "
                       f"*.safetensors)")
    quants = ", ".join(sorted({quant_label(m) for m in models}))
    if name.quant is not None:
        chosen = _matching(models, name.quant, "model", str(name))
        if chosen is None:
            raise HubError(f"{name}: {name.repo} has no quant '{name.quant}'; it has: {quants}")
    else:
        chosen = next((c for q in DEFAULT_QUANTS if (c := _matching(models, q, "model", str(name)))), None)
        if chosen is None and len(models) > 1:
            raise HubError(f"{name}: {name.repo} has several models and no {' or '.join(DEFAULT_QUANTS)}; "
                           f"pick one with hf.co/{name.repo}:QUANT ({quants})")
        chosen = chosen or models[0]
    return _split_parts(chosen, files)


def choose_tower(files: list[str], model: str, wanted: str | None = None) -> str | None:
    """The vision tower (mmproj*.gguf) for `model` among `files`: beside it, else at the repository's
    root; `wanted` names one (as a quant or file name), otherwise the model's own precision
    (BF16/F16/F32) where there is one, then TOWER_PRECISIONS' order. None when there is none."""
    towers = [f for f in files if f.lower().endswith(".gguf") and "mmproj" in PurePosixPath(f).name.lower()]
    folder = str(PurePosixPath(model).parent)
    towers = sorted([t for t in towers if str(PurePosixPath(t).parent) == folder]
                    or [t for t in towers if "/" not in t])
    if wanted is not None:
        chosen = _matching(towers, wanted, "tower", model)
        if chosen is None:
            raise HubError(f"--mmproj {wanted}: no such vision tower beside {model}; there are: "
                           f"{', '.join(towers) or 'none'}")
        return chosen
    own = quant_label(model)
    for precision in ((own,) if own in TOWER_PRECISIONS else ()) + TOWER_PRECISIONS:
        chosen = next((t for t in towers if quant_label(t) == precision), None)
        if chosen:
            return chosen
    return towers[0] if towers else None


# -- the huggingface_hub cache -----------------------------------------------------------------

def cache_dir() -> Path:
    """HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (as huggingface_hub reads them)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def repo_dir(repo: str) -> Path:
    return cache_dir() / ("models--" + repo.replace("/", "--"))


def _snapshot_files(snapshot: Path) -> list[str]:
    """Repository paths of the files a snapshot holds (links whose blob is there)."""
    return sorted(str(p.relative_to(snapshot).as_posix()) for p in snapshot.rglob("*") if p.is_file())


def _ref_names(repo: Path) -> dict[str, list[str]]:
    """commit -> the refs (branches, tags) that point at it."""
    refs: dict[str, list[str]] = {}
    if (repo / "refs").is_dir():
        for ref in sorted(p for p in (repo / "refs").rglob("*") if p.is_file()):
            refs.setdefault(ref.read_text().strip(), []).append(str(ref.relative_to(repo / "refs").as_posix()))
    return refs


def _local_commit(repo: Path, revision: str | None) -> str | None:
    """The snapshot a revision names in the cache: a ref's commit, or a commit (or its prefix)."""
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        commit = ref.read_text().strip()
        return commit if _COMMIT.fullmatch(commit) else None
    if revision and re.fullmatch(r"[0-9a-f]{7,40}", revision) and (repo / "snapshots").is_dir():
        found = [d.name for d in (repo / "snapshots").iterdir() if d.name.startswith(revision)]
        return found[0] if len(found) == 1 else None
    return None


@dataclass(frozen=True)
class HubModel:
    """A Hub model in the cache: its path (a GGUF, a split GGUF's first part or a checkpoint
    directory), its vision tower's if stored, and the snapshot holding them."""

    name: str  # what to type to get this model: hf.co/USER/REPO[:QUANT][@REVISION]
    path: Path
    tower: Path | None
    snapshot: Path
    files: tuple[str, ...]  # the model's files, as paths in the repository
    refs: tuple[str, ...] = ()  # the branches and tags at this snapshot

    @property
    def commit(self) -> str:
        return self.snapshot.name

    @property
    def quant(self) -> str | None:
        return quant_label(self.files[0]) if self.path.is_file() else None

    @property
    def size(self) -> int:
        return sum((self.snapshot / f).stat().st_size for f in self.files)

    def file_record(self, path: Path) -> dict:
        """file, path, size and sha256 of one of the snapshot's files (an LFS blob is named by its sha256)."""
        blob = path.resolve().name
        if not re.fullmatch(r"[0-9a-f]{64}", blob):
            blob = _hash_file(path, hashlib.sha256()).hexdigest()
        return {"file": path.relative_to(self.snapshot).as_posix(), "path": str(path), "size": path.stat().st_size,
                "sha256": blob}


def _tower_choices_path() -> Path:
    """What `pull` chose as each model's tower (None: --no-mmproj), by the model's snapshot path."""
    return home() / "hub-towers.json"


def _quant_choices_path() -> Path:
    """The model file `pull` chose for each name without a quant (hf.co/USER/REPO[@REVISION])."""
    return home() / "hub-quants.json"


def _remember_tower(model: Path, tower: str | None, forget: bool = False) -> None:
    with records.updating(_tower_choices_path()) as choices:
        if forget:
            choices.pop(str(model), None)
        else:
            choices[str(model)] = tower


def _tower_of(snapshot: Path, model: str, files: list[str]) -> str | None:
    """The tower a model in a snapshot goes with: the one `pull` chose for it if still there, else
    choose_tower's pick among the snapshot's files."""
    chosen = records.read_record(_tower_choices_path()).get(str(snapshot / model), "")
    if chosen is None or chosen in files:
        return chosen
    return choose_tower(files, model)


def architecture(path: Path) -> str | None:
    """The architecture a model's file names: a GGUF's general.architecture, a directory's
    config.json model_type; None when it cannot be read (a split's part, a broken file)."""
    try:
        if path.is_dir():
            kind = read_json_file(str(path / "config.json"), CONFIG_LIMIT).get("model_type")
        else:
            with GGUFFile.open(path) as file:
                kind = file.metadata.get("general.architecture")
    except PagelmError:
        return None
    return kind if isinstance(kind, str) else None


def _is_vision_model(path: Path) -> bool:
    """Whether pagelm reads images with this model (a GGUF whose architecture has a tower)."""
    return not path.is_dir() and architecture(path) in VISION_ARCHITECTURES


def _cached_snapshot(name: HubName) -> Path | None:
    """The snapshot folder of the revision `name` asks for, if the cache has it."""
    repo = repo_dir(name.repo)
    commit = _local_commit(repo, name.revision)
    snapshot = repo / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def _cached_choice(name: HubName, files: list[str]) -> list[str]:
    """choose_model among a snapshot's files, except that a name without a quant means the model
    `pull` chose for it: the quant it would choose may be one the cache lacks. HubError when pull
    chose none (or it is gone)."""
    if name.quant is None and _model_ggufs(files):
        chosen = records.read_record(_quant_choices_path()).get(str(name))
        if chosen not in files:
            raise HubError(f"{name}: no quant chosen for this name yet")
        return _split_parts(chosen, files)
    return choose_model(files, name)


def locate_cached(name: HubName) -> HubModel | None:
    """The model `name` names if the cache holds all its files, with no network access; else None."""
    snapshot = _cached_snapshot(name)
    if snapshot is None:
        return None
    files = _snapshot_files(snapshot)
    try:
        chosen = _cached_choice(name, files)
    except HubError:
        return None
    if chosen[0].lower().endswith(".gguf"):
        path = snapshot / chosen[0]
        tower = _tower_of(snapshot, chosen[0], files)
        tower_path = snapshot / tower if tower and _is_vision_model(path) else None
    else:
        path, tower_path = snapshot, None  # a checkpoint directory's mmproj.gguf is found in it
    return HubModel(str(name), path, tower_path, snapshot, tuple(chosen))


def _token_hint() -> str:
    return "set HF_TOKEN or pass --token for a private or gated one"


def _hub_failure(name: HubName, error: Exception) -> HubError:
    """One line for what huggingface_hub or the network raised while listing a repository."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RevisionNotFoundError

    if isinstance(error, RevisionNotFoundError):
        return HubError(f"{name}: {name.repo} has no revision '{name.revision}'")
    if isinstance(error, OfflineModeIsEnabled):
        return _offline_miss(name)
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403, 404):
            return HubError(f"{name}: repository {name.repo} is private, gated or does not exist "
                            f"(HTTP {status}; {_token_hint()})")
        return HubError(f"{name}: the Hub answered HTTP {status} listing {name.repo}")
    first_line = (str(error).splitlines() or [""])[0]
    return HubError(f"{name}: cannot reach the Hub at {_endpoint()} ({type(error).__name__}: {first_line})")


def _offline_miss(name: HubName) -> HubError:
    snapshot = _cached_snapshot(name)
    cached = sorted({quant_label(m) for m in _model_ggufs(_snapshot_files(snapshot))}) if snapshot else []
    if name.quant is None and cached:
        return HubError(f"{name}: names no quant, and which one `pull` would choose is not known offline; the "
                        f"cache holds {', '.join(cached)}: name one (hf.co/{name.repo}:QUANT) or pull it while online")
    return HubError(f"{name}: not in the Hugging Face cache ({cache_dir()}) and HF_HUB_OFFLINE is set; "
                    f"pull it while online")


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


@dataclass(frozen=True)
class RemoteFile:
    path: str  # in the repository
    size: int
    etag: str  # the blob's name: the LFS sha256, or the git blob id of a small file
    lfs: bool


_ETAG = {True: re.compile(r"[0-9a-f]{64}"), False: re.compile(r"[0-9a-f]{40}")}  # by `lfs`


def _is_safe_repo_path(path: str) -> bool:
    """Whether `path` names a file inside a snapshot folder: relative, of plain segments (no '..',
    '.' or empty one), without backslashes or NUL (as huggingface_hub's _get_pointer_path)."""
    return "\\" not in path and "\0" not in path and all(s not in ("", ".", "..") for s in path.split("/"))


def _checked(name: HubName, remote: RemoteFile) -> RemoteFile:
    """`remote` as the listing gives it, if its path, blob name and size can be stored in the cache."""
    if not isinstance(remote.path, str) or not _is_safe_repo_path(remote.path):
        raise HubError(f"{name}: the Hub listed a file named {remote.path!r} in {name.repo}, which is not a path "
                       f"inside a repository; nothing was stored")
    if not isinstance(remote.etag, str) or not _ETAG[remote.lfs].fullmatch(remote.etag):
        raise HubError(f"{name}: the Hub listed {remote.path} with blob id {remote.etag!r}, not a "
                       f"{'sha256' if remote.lfs else 'git blob sha1'}; nothing was stored")
    if not isinstance(remote.size, int) or remote.size < 0:
        raise HubError(f"{name}: the Hub listed {remote.path} with size {remote.size!r}; nothing was stored")
    return remote


def _listing(name: HubName, token: str | None) -> tuple[str, dict[str, RemoteFile]]:
    """(commit, repository path -> RemoteFile) of the revision `name` asks for."""
    from huggingface_hub import HfApi

    for failures in range(1, RETRIES + 2):
        try:
            info = HfApi(endpoint=_endpoint()).model_info(name.repo, revision=name.revision, files_metadata=True,
                                                           token=token)
            break
        except Exception as e:  # noqa: BLE001 - every failure becomes one line (_hub_failure names it)
            if failures > RETRIES or not _is_transient(e):
                raise _hub_failure(name, e) from None
            _back_off(failures)
    if not isinstance(info.sha, str) or not _COMMIT.fullmatch(info.sha):
        raise HubError(f"{name}: the Hub answered commit id {info.sha!r} for {name.repo}, not 40 hex digits; "
                       f"nothing was stored")
    files = {}
    for sibling in info.siblings or []:
        if sibling.lfs is not None:
            remote = RemoteFile(sibling.rfilename, sibling.lfs.size, sibling.lfs.sha256, True)
        elif sibling.blob_id is not None and sibling.size is not None:
            remote = RemoteFile(sibling.rfilename, sibling.size, sibling.blob_id, False)
        else:
            continue
        files[remote.path] = _checked(name, remote)
    return info.sha, files


def _is_transient(error: Exception) -> bool:
    """A listing failure worth another try: the Hub busy (5xx, 429) or a connection lost midway;
    not a refused connection or an unknown host (no network: say so at once)."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError):
        return error.response is not None and (error.response.status_code >= 500 or error.response.status_code == 429)
    return isinstance(error, httpx2.TransportError) and not isinstance(error, httpx2.ConnectError)


def _back_off(failures: int) -> None:
    time.sleep(min(BACKOFF_S * 2 ** (failures - 1), MAX_BACKOFF_S))


def _digest(remote: RemoteFile):
    """The hash the Hub names the file by: sha256 of an LFS file, git's blob sha1 of a small one."""
    if remote.lfs:
        return hashlib.sha256()
    digest = hashlib.sha1()
    digest.update(f"blob {remote.size}\0".encode())
    return digest


def _hash_file(path: Path, digest):
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest


class _Retry(Exception):
    """A failure worth another attempt (connection, 5xx, 429)."""


def _body_start(response) -> int | None:
    """Where in the file a download's body starts: 0 for a 200, the first byte a 206's
    Content-Range names; None when that is not given."""
    if response.status_code == 200:
        return 0
    match = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("content-range", "").strip())
    return int(match.group(1)) if match else None


def _fetch(url: str, part: Path, remote: RemoteFile, headers: dict, name: HubName, show_progress: bool,
           on_bytes: OnBytes | None = None):
    """Download `remote` into `part`, resuming from what `part` holds; returns its hash object. `on_bytes(part, have,
    size)` after each block written."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session
    from tqdm import tqdm

    digest, have = _digest(remote), part.stat().st_size if part.is_file() else 0
    if have > remote.size:
        part.unlink()
        have = 0
    part.touch()
    _hash_file(part, digest)  # what an earlier attempt left: resumed, not fetched again
    failures = 0
    with tqdm(total=remote.size, initial=have, unit="B", unit_scale=True, file=sys.stderr, disable=not show_progress,
              desc=f"pulling {PurePosixPath(remote.path).name}") as bar:
        while have < remote.size:
            progressed = False
            try:
                # identity: the bytes hashed are the bytes sent, and a small body never inflates in memory
                ranged = {**headers, "Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
                with get_session().stream("GET", url, headers=ranged, follow_redirects=True,
                                          timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                    status = response.status_code
                    if status in (401, 403, 404):
                        raise HubError(f"{name}: {remote.path} is private, gated or does not exist in {name.repo} "
                                       f"(HTTP {status}; {_token_hint()})")
                    if status == 429 or status >= 500:
                        raise _Retry(f"HTTP {status}")
                    if status not in (200, 206):
                        raise HubError(f"{name}: HTTP {status} downloading {remote.path}")
                    start = _body_start(response)
                    if start == 0 and have:  # the whole file again (the Range ignored): start over
                        part.write_bytes(b"")
                        digest, have = _digest(remote), 0
                        bar.reset(total=remote.size)
                    elif start != have:
                        part.unlink()
                        raise HubError(f"{name}: asked for {remote.path} from byte {have}, the Hub answered with "
                                       f"Content-Range {response.headers.get('content-range')!r}; the partial "
                                       f"download was deleted and nothing was stored")
                    with open(part, "ab") as out:
                        for block in response.iter_raw():  # as it arrives: a cut loses nothing read
                            if have + len(block) > remote.size:
                                part.unlink()
                                raise HubError(f"{name}: the Hub sent more of {remote.path} than the "
                                               f"{remote.size} bytes it lists (stopped reading at "
                                               f"{have + len(block)}); the download was deleted and nothing "
                                               f"was stored")
                            out.write(block)
                            digest.update(block)
                            have += len(block)
                            bar.update(len(block))
                            progressed = True
                            if on_bytes is not None:
                                out.flush()
                                on_bytes(part, have, remote.size)
                    if have < remote.size:
                        raise _Retry(f"the connection ended after {have} of {remote.size} bytes")
            except (_Retry, httpx2.TransportError) as e:
                failures = 1 if progressed else failures + 1
                if failures > RETRIES:
                    reason = (str(e).splitlines() or [type(e).__name__])[0]
                    raise HubError(f"{name}: downloading {remote.path} failed {failures} times ({reason}); "
                                   f"{have} of {remote.size} bytes kept in {part}, `pagelm pull {name}` resumes") from None
                _back_off(failures)
    return digest


def _fetch_blob(repo: Path, name: HubName, commit: str, remote: RemoteFile, token: str | None,
                show_progress: bool, on_bytes: OnBytes | None = None) -> Path:
    """The blob of `remote` in the cache: there already (0 bytes fetched), or downloaded and checked."""
    from urllib.parse import quote

    from filelock import FileLock
    from huggingface_hub.utils import build_hf_headers

    blob = repo / "blobs" / remote.etag
    if blob.is_file() and blob.stat().st_size == remote.size:
        return blob
    blob.parent.mkdir(parents=True, exist_ok=True)
    locks = cache_dir() / ".locks" / repo.name
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / f"{remote.etag}.lock")):  # the lock huggingface_hub takes for the same blob
        if blob.is_file() and blob.stat().st_size == remote.size:
            return blob
        part = blob.with_name(remote.etag + ".incomplete")
        url = f"{_endpoint()}/{name.repo}/resolve/{commit}/{quote(remote.path)}"
        digest = _fetch(url, part, remote, build_hf_headers(token=token), name, show_progress, on_bytes)
        if digest.hexdigest() != remote.etag:
            part.unlink()
            kind = "sha256" if remote.lfs else "git blob sha1"
            raise HubError(f"{name}: {remote.path} downloaded with {kind} {digest.hexdigest()}, the Hub lists "
                           f"{remote.etag}; the download was deleted and nothing was stored")
        os.replace(part, blob)
    return blob


def _link(name: HubName, snapshot: Path, path: str, blob: Path) -> None:
    """snapshots/COMMIT/PATH -> ../../blobs/ETAG, as huggingface_hub links them."""
    target = snapshot / path
    if not (target.parent.resolve() / target.name).is_relative_to(snapshot.resolve()):  # a folder linked out
        raise HubError(f"{name}: {path} would be stored outside {snapshot}; nothing was linked")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_file() and target.resolve() == blob.resolve():
        return
    link = records.temporary_name(target)
    try:
        link.symlink_to(os.path.relpath(blob, target.parent))
        os.replace(link, target)
    finally:
        link.unlink(missing_ok=True)


def _refuse_split(name: HubName, files: list[str] | tuple[str, ...], first: Path) -> None:
    if files[0].lower().endswith(".gguf") and len(files) > 1:
        raise HubError(f"{name}: a GGUF split in {len(files)} parts, and pagelm opens single files; merge them "
                       f"with llama.cpp's `llama-gguf-split --merge {first} OUT.gguf` (after `pagelm pull {name}`), "
                       f"then use OUT.gguf")


def pull(text: str | HubName, token: str | None = None, mmproj: str | None = None, no_mmproj: bool = False,
         show_progress: bool = True, single_file: bool = False, on_bytes: OnBytes | None = None) -> HubModel:
    """Bring a Hub model (and, for a Qwen3.5, its vision tower) into the cache; files already there
    are used in place. Offline (HF_HUB_OFFLINE), only what the cache holds. `single_file`: a split
    GGUF is refused before any of it is fetched. `on_bytes(part, have, size)` as the model's (first) file
    arrives, its first `have` of `size` bytes in `part`."""
    name = text if isinstance(text, HubName) else parse_name(text)
    if name is None:
        raise HubError(f"{text}: not a Hub model name ({NAME_FORMS})")
    if is_offline():
        located = locate_cached(name)
        if located is None:
            raise _offline_miss(name)
        return located
    commit, remote = _listing(name, token)
    chosen = choose_model(sorted(remote), name)
    repo = repo_dir(name.repo)
    snapshot = repo / "snapshots" / commit
    if single_file:
        _refuse_split(name, chosen, snapshot / chosen[0])
    for path in chosen:
        _link(name, snapshot, path, _fetch_blob(repo, name, commit, remote[path], token, show_progress,
                                                on_bytes if path == chosen[0] else None))
    model_path = snapshot / chosen[0] if chosen[0].lower().endswith(".gguf") else snapshot
    tower = None if no_mmproj or model_path.is_dir() else choose_tower(sorted(remote), chosen[0], mmproj)
    if tower is not None and not _is_vision_model(model_path):
        if mmproj is not None:
            raise HubError(f"--mmproj {mmproj}: {name} is not a model pagelm reads images with")
        tower = None
    if tower is not None:
        _link(name, snapshot, tower, _fetch_blob(repo, name, commit, remote[tower], token, show_progress))
    if model_path.is_file():
        _remember_tower(model_path, tower)
        if name.quant is None:
            with records.updating(_quant_choices_path()) as choices:
                choices[str(name)] = chosen[0]
    if name.revision != commit:
        records.write_atomically(repo / "refs" / (name.revision or "main"), commit)
    return HubModel(str(name), model_path, snapshot / tower if tower else None, snapshot, tuple(chosen))


def locate(text: str | HubName, show_progress: bool = True) -> HubModel:
    """A Hub model's files, to open: from the cache when it holds them (no network access), else
    pulled. A split GGUF is an error (pagelm opens single files)."""
    name = text if isinstance(text, HubName) else parse_name(text)
    if name is None:
        raise HubError(f"{text}: not a Hub model name ({NAME_FORMS})")
    located = locate_cached(name)
    if located is None:
        return pull(name, token=None, show_progress=show_progress, single_file=True)
    _refuse_split(name, located.files, located.path)
    return located


# -- what the cache holds: list and remove -----------------------------------------------------

def _models_in(repo_id: str, snapshot: Path, refs: list[str]) -> list[HubModel]:
    files = _snapshot_files(snapshot)
    suffix = "" if "main" in refs else f"@{refs[0] if refs else snapshot.name[:12]}"
    found = []
    for model in _model_ggufs(files):
        try:
            parts = _split_parts(model, files)
        except HubError:
            continue  # a split model whose parts are not all here
        tower = _tower_of(snapshot, model, files)
        found.append(HubModel(f"hf.co/{repo_id}:{quant_label(model)}{suffix}", snapshot / model,
                              snapshot / tower if tower else None, snapshot, tuple(parts), tuple(refs)))
    checkpoint = [f for f in files if _CHECKPOINT_FILE.fullmatch(f)]
    if "config.json" in checkpoint and any(f.endswith(".safetensors") for f in checkpoint):
        found.append(HubModel(f"hf.co/{repo_id}{suffix}", snapshot, None, snapshot, tuple(checkpoint), tuple(refs)))
    return found


def list_models() -> list[HubModel]:
    """Every GGUF model and safetensors checkpoint in the cache's model repositories, whoever
    downloaded it (pagelm, huggingface_hub, transformers, llama.cpp)."""
    if not cache_dir().is_dir():
        return []
    found = []
    for repo in sorted(cache_dir().glob("models--*--*")):
        repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        refs = _ref_names(repo)
        for snapshot in sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []:
            found += _models_in(repo_id, snapshot, refs.get(snapshot.name, []))
    return found


def remove(text: str) -> list[Path]:
    """Remove a Hub model from the cache: its files from its snapshot (the whole snapshot, and refs
    to it, once no model is left in it), then every blob no snapshot of the repository links to.
    A process that has a removed file mapped keeps reading it (an unlink, never a rewrite).
    Returns the paths removed."""
    name = parse_name(text)
    located = locate_cached(name) if name else None
    if located is None:
        raise HubError(f"{text}: no such Hub model in the Hugging Face cache ({cache_dir()}); `pagelm list` "
                       f"shows what is there")
    repo, snapshot = repo_dir(name.repo), located.snapshot
    removed = [snapshot / f for f in located.files]
    for path in removed:
        path.unlink()
    _remember_tower(located.path, None, forget=True)
    remaining = _models_in(name.repo, snapshot, [])
    if not remaining:
        shutil.rmtree(snapshot)
        removed = [snapshot]
        for ref in _ref_names(repo).get(located.commit, []):
            (repo / "refs" / ref).unlink()
    elif located.tower and all(m.tower != located.tower for m in remaining):  # no other model's tower
        located.tower.unlink()
        removed.append(located.tower)
    linked = {p.resolve() for p in (repo / "snapshots").rglob("*") if p.is_symlink()}
    for blob in (repo / "blobs").iterdir() if (repo / "blobs").is_dir() else []:
        if blob.suffix != ".incomplete" and blob.resolve() not in linked:
            blob.unlink()
    if not any((repo / "snapshots").iterdir()):
        shutil.rmtree(repo)
    return removed
