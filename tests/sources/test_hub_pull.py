"""`pagelm pull/run/serve/list/rm hf.co/…` against the loopback Hub: the model and its tower stored
in the Hugging Face cache layout, used offline, resumed, verified, and every failure one line. One
file, so that one session's loopback Hub and synthetic models serve every test."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from hub_server import CHUNK, HF_DIR, PRIVATE, QWEN, SPLIT, TINY, TOKEN, Fault, Hostile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))  # the serve tests' process helpers
from serve_helpers import ServerProcess, openai_chat, png  # noqa: E402


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _snapshot(env: dict, repo: str) -> Path:
    repo_dir = Path(env["HF_HUB_CACHE"]) / ("models--" + repo.replace("/", "--"))
    return repo_dir / "snapshots" / (repo_dir / "refs" / "main").read_text()


def _one_line_error(result, *words: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("pulling ")]  # the bars
    assert len(lines) == 1 and lines[0].startswith("pagelm: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_pull_stores_model_and_tower_run_answers_with_an_image_list_shows_both(hub, hub_files, env, pagelm,
                                                                             tmp_path):
    from PIL import Image

    pulled = pagelm("pull", f"hf.co/{QWEN}:Q8_0")
    assert pulled.returncode == 0, pulled.stderr
    snapshot = _snapshot(env, QWEN)
    model, tower = snapshot / "qwen-tiny-Q8_0.gguf", snapshot / "mmproj-F16.gguf"  # F16: Q8_0 has no own precision
    assert sorted(p.name for p in snapshot.iterdir()) == ["mmproj-F16.gguf", "qwen-tiny-Q8_0.gguf"]
    assert model.is_symlink() and model.resolve().name == _sha256(hub_files["qwen-Q8_0"])
    assert tower.resolve().name == _sha256(hub_files["mmproj-F16"])
    assert f"{model} (" in pulled.stdout and f"tower: {tower}" in pulled.stdout
    sizes = {p: os.path.getsize(hub_files[k]) for p, k in [("qwen-tiny-Q8_0.gguf", "qwen-Q8_0"),
                                                           ("mmproj-F16.gguf", "mmproj-F16")]}
    assert {path: n for (_, path), n in hub.sent.items()} == sizes  # each file once, nothing else

    listed = pagelm("list")
    assert listed.returncode == 0, listed.stderr
    name_line = next(line for line in listed.stdout.splitlines() if line.startswith(f"hf.co/{QWEN}:Q8_0 "))
    assert " qwen35 " in name_line and "Q8_0, revision main" in name_line and str(model) in name_line
    assert "+ tower mmproj-F16.gguf" in listed.stdout
    entries = {e["name"]: e for e in json.loads(pagelm("list", "--json").stdout)}
    entry = entries[f"hf.co/{QWEN}:Q8_0"]
    assert entry["sha256"] == _sha256(hub_files["qwen-Q8_0"]) and entry["size"] == sizes["qwen-tiny-Q8_0.gguf"]
    assert entry["revision"] == snapshot.name and entry["file"] == "qwen-tiny-Q8_0.gguf"
    assert entry["architecture"] == "qwen35"
    assert entry["tower"]["sha256"] == _sha256(hub_files["mmproj-F16"])

    image = tmp_path / "red.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(image)
    hub.reset_counts()
    ran = pagelm("run", f"hf.co/{QWEN}:Q8_0", "What is in the picture?", "--image", str(image), "--max-tokens", "3",
                 "--json")
    assert ran.returncode == 0, ran.stderr
    answer = json.loads(ran.stdout.strip().splitlines()[-1])
    assert answer["completion_tokens"] >= 1 and answer["prompt_tokens"] > 64  # the image's tokens are in the prompt
    assert hub.requests == []  # found in the cache: no Hub call at all

    offline = pagelm("run", f"hf.co/{QWEN}:Q8_0", "Hi", "--image", str(image), "--max-tokens", "2",
                     extra={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.strip() and hub.requests == []


def test_a_file_already_in_the_hf_cache_is_used_with_nothing_fetched(hub, env, pagelm):
    from huggingface_hub import hf_hub_download

    for name in ("qwen-tiny-Q4_0.gguf", "mmproj-F16.gguf"):  # as huggingface_hub itself downloads them
        hf_hub_download(QWEN, name, cache_dir=env["HF_HUB_CACHE"], endpoint=hub.url)
    hub.reset_counts()
    pulled = pagelm("pull", f"hf.co/{QWEN}:q4_0")  # quants match case-insensitively
    assert pulled.returncode == 0, pulled.stderr
    assert hub.fetched(QWEN) == 0 and not [r for r in hub.requests if r[0] == "GET"]
    assert f"{_snapshot(env, QWEN) / 'qwen-tiny-Q4_0.gguf'} (" in pulled.stdout


def test_a_pull_cut_at_half_resumes_and_fetches_only_the_rest(hub, hub_files, env, pagelm):
    size = os.path.getsize(hub_files["tiny-a2"])
    hub.faults[(TINY, "tiny-Q8_0.gguf")] = Fault(drop_at=0.5)
    pulled = pagelm("pull", f"hf.co/{TINY}:Q8_0")
    assert pulled.returncode == 0, pulled.stderr
    assert size <= hub.sent[(TINY, "tiny-Q8_0.gguf")] <= size + CHUNK
    gets = [r for r in hub.requests if r[0] == "GET"]
    assert len(gets) == 2 and gets[0][2] is None and int(gets[1][2].removeprefix("bytes=").rstrip("-")) >= size // 2
    assert _sha256(_snapshot(env, TINY) / "tiny-Q8_0.gguf") == _sha256(hub_files["tiny-a2"])


def _children(pid: int) -> list[str]:
    return [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def test_a_pull_compiles_its_kernels_beside_the_download_once_the_header_has_arrived(hub, hub_files, env):
    """The download held at half the file (its header long arrived): the compile process is already running (or
    done and not yet reaped); once the rest arrives, the pull waits for it and ends."""
    size = os.path.getsize(hub_files["tiny-a2"])
    held = hub.faults[(TINY, "tiny-Q8_0.gguf")] = Fault(hold_at=0.5)
    process = subprocess.Popen([sys.executable, "-m", "pagelm", "pull", f"hf.co/{TINY}:Q8_0"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while hub.sent.get((TINY, "tiny-Q8_0.gguf"), 0) < size // 2 or not _children(process.pid):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no compile process while the download was held"
            time.sleep(0.05)
        assert hub.sent[(TINY, "tiny-Q8_0.gguf")] < size  # still held
    finally:
        held.released.set()
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "not compiled ahead" not in stderr


def test_a_busy_hub_is_retried_with_backoff(hub, hub_files, env, pagelm):
    hub.busy_listings = 1
    hub.faults[(TINY, "tiny-Q4_0.gguf")] = Fault(unavailable=2)
    pulled = pagelm("pull", f"hf.co/{TINY}:Q4_0")
    assert pulled.returncode == 0, pulled.stderr
    assert len([r for r in hub.requests if r[0] == "GET"]) == 3
    assert hub.sent[(TINY, "tiny-Q4_0.gguf")] == os.path.getsize(hub_files["tiny-b"])


def _interruptible() -> None:
    # a job started in the background by a shell ignores SIGINT, and Python keeps it ignored: as
    # in a terminal, Ctrl-C must reach the pull
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_on_a_slow_pull_leaves_a_resumable_part_and_no_model(hub, hub_files, env, pagelm):
    size = os.path.getsize(hub_files["tiny-a2"])
    slow = hub.faults[(TINY, "tiny-Q8_0.gguf")] = Fault(delay=0.02, hold_at=0.5)
    process = subprocess.Popen([sys.executable, "-m", "pagelm", "pull", f"hf.co/{TINY}:Q8_0"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_interruptible)
    try:
        while hub.sent.get((TINY, "tiny-Q8_0.gguf"), 0) < size // 2:  # then the server stalls
            assert process.poll() is None, process.communicate()
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        slow.released.set()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    bars = [line for line in stderr.splitlines() if line.startswith("pulling tiny-Q8_0.gguf:")]
    assert len({bar.split("|")[0] for bar in bars}) >= 3  # the bar kept moving while bytes came
    repo = Path(env["HF_HUB_CACHE"]) / f"models--{TINY.replace('/', '--')}"
    parts = list((repo / "blobs").glob("*.incomplete"))
    assert len(parts) == 1 and parts[0].stat().st_size > 0
    assert not (repo / "snapshots").exists() or not any((repo / "snapshots").rglob("*.gguf"))
    kept = parts[0].stat().st_size

    hub.faults.clear()
    hub.reset_counts()
    resumed = pagelm("pull", f"hf.co/{TINY}:Q8_0")
    assert resumed.returncode == 0, resumed.stderr
    assert [r[2] for r in hub.requests if r[0] == "GET"] == [f"bytes={kept}-"]
    assert hub.sent[(TINY, "tiny-Q8_0.gguf")] == size - kept
    assert _sha256(_snapshot(env, TINY) / "tiny-Q8_0.gguf") == _sha256(hub_files["tiny-a2"])


def test_a_corrupted_download_is_never_stored(hub, env, pagelm):
    hub.faults[(TINY, "tiny-Q8_0.gguf")] = Fault(corrupt=True)
    pulled = pagelm("pull", f"hf.co/{TINY}:Q8_0")
    _one_line_error(pulled, "sha256", "tiny-Q8_0.gguf", "nothing was stored")
    repo = Path(env["HF_HUB_CACHE"]) / f"models--{TINY.replace('/', '--')}"
    assert not list((repo / "blobs").iterdir()) and not (repo / "snapshots").exists()
    assert TINY not in pagelm("list").stdout


def test_failures_are_one_line_with_exit_status_1(hub, env, pagelm):
    _one_line_error(pagelm("pull", f"hf.co/{PRIVATE}:Q8_0"), PRIVATE, "private, gated or does not exist")
    _one_line_error(pagelm("pull", "hf.co/org/no-such-repo"), "org/no-such-repo", "private, gated or does not exist")
    _one_line_error(pagelm("pull", f"hf.co/{QWEN}:Q5_K_M"), "Q5_K_M", "Q4_0, Q8_0")
    _one_line_error(pagelm("pull", f"hf.co/{QWEN}:Q8_0@v9"), "no revision 'v9'")
    _one_line_error(pagelm("pull", "hf.co/not a name"), "not a Hub model name")
    _one_line_error(pagelm("pull", "hf.co/org--x/tiny"), "'org--x/tiny' is not a repository name the Hub allows")
    _one_line_error(pagelm("run", f"hf.co/{QWEN}:Q8_0", "Hi", extra={"HF_HUB_OFFLINE": "1"}),
                    "not in the Hugging Face cache", "HF_HUB_OFFLINE")
    _one_line_error(pagelm("pull", f"hf.co/{QWEN}", extra={"HF_ENDPOINT": "http://127.0.0.1:9"}), "cannot reach")
    assert pagelm("pull", f"hf.co/{PRIVATE}:Q8_0", "--token", TOKEN).returncode == 0


def test_private_repository_with_hf_token(hub, env, pagelm):
    pulled = pagelm("pull", f"{PRIVATE}:Q8_0", extra={"HF_TOKEN": TOKEN})
    assert pulled.returncode == 0, pulled.stderr
    assert (_snapshot(env, PRIVATE) / "tiny-Q8_0.gguf").is_file()


def test_split_gguf_is_fetched_whole_and_run_refuses_it_before_fetching_any(hub, hub_files, env, pagelm):
    _one_line_error(pagelm("run", f"hf://{SPLIT}", "Hi"), "split in 2 parts", "llama-gguf-split --merge")
    assert hub.fetched(SPLIT) == 0 and not [r for r in hub.requests if r[0] == "GET"]
    pulled = pagelm("pull", f"hf://{SPLIT}")
    assert pulled.returncode == 0, pulled.stderr
    snapshot = _snapshot(env, SPLIT)
    parts = sorted(snapshot.iterdir())
    assert [p.name for p in parts] == ["tiny-Q8_0-00001-of-00002.gguf", "tiny-Q8_0-00002-of-00002.gguf"]
    assert b"".join(p.read_bytes() for p in parts) == Path(hub_files["tiny-a"]).read_bytes()
    entry = next(e for e in json.loads(pagelm("list", "--json").stdout) if e["name"] == f"hf.co/{SPLIT}:Q8_0")
    assert entry["size"] == os.path.getsize(hub_files["tiny-a"]) and len(entry["files"]) == 2
    _one_line_error(pagelm("run", f"hf://{SPLIT}", "Hi"), "split in 2 parts", "llama-gguf-split --merge")


def test_safetensors_repository_is_pulled_as_a_checkpoint_directory(hub, hub_files, env, pagelm):
    pulled = pagelm("pull", f"hf.co/{HF_DIR}")
    assert pulled.returncode == 0, pulled.stderr
    snapshot = _snapshot(env, HF_DIR)
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in Path(hub_files["hf"]).iterdir())
    assert (HF_DIR, "README.md") not in hub.sent and (HF_DIR, "original/consolidated.pth") not in hub.sent
    assert f"hf.co/{HF_DIR} " in pagelm("list").stdout
    _one_line_error(pagelm("pull", f"hf.co/{HF_DIR}:Q8_0"), "safetensors checkpoint")


def test_revision_pins_and_rm_keeps_shared_blobs(hub, hub_files, env, pagelm):
    old = hub.old_tiny
    for name in (f"hf.co/{TINY}:Q8_0@{old}", f"hf.co/{TINY}:Q4_0@{old}", f"hf.co/{TINY}:Q4_0"):
        assert pagelm("pull", name).returncode == 0
    repo = Path(env["HF_HUB_CACHE"]) / f"models--{TINY.replace('/', '--')}"
    assert _sha256(repo / "snapshots" / old / "tiny-Q8_0.gguf") == _sha256(hub_files["tiny-a"])  # the old bytes
    entries = {e["name"]: e for e in json.loads(pagelm("list", "--json").stdout)}
    pinned = entries[f"hf.co/{TINY}:Q8_0@{old[:12]}"]
    assert pinned["revision"] == old and pinned["sha256"] == _sha256(hub_files["tiny-a"])
    assert entries[f"hf.co/{TINY}:Q4_0"]["revision"] == hub.refs[TINY]["main"]

    shared = repo / "blobs" / _sha256(hub_files["tiny-b"])
    removed = pagelm("rm", f"hf.co/{TINY}:Q8_0@{old[:12]}")
    assert removed.returncode == 0, removed.stderr
    assert not (repo / "blobs" / _sha256(hub_files["tiny-a"])).exists() and shared.is_file()
    assert pagelm("rm", f"hf.co/{TINY}:Q4_0@{old[:12]}").returncode == 0
    assert not (repo / "snapshots" / old).exists() and shared.is_file()  # main's snapshot still links it
    assert pagelm("rm", f"hf.co/{TINY}:Q4_0").returncode == 0
    assert not repo.exists()
    _one_line_error(pagelm("rm", f"hf.co/{TINY}:Q4_0"), "no such Hub model")


def test_load_and_run_pull_a_name_not_in_the_cache(hub, env, pagelm, monkeypatch):
    from huggingface_hub import constants

    import pagelm as pagelm_module

    from pagelm.bench.inputs import model_path

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.setenv("PAGELM_HOME", env["PAGELM_HOME"])
    model = pagelm_module.load(f"hf.co/{TINY}:Q4_0", threads=1)
    assert model.file.path == str(_snapshot(env, TINY) / "tiny-Q4_0.gguf")
    assert model_path(f"hf.co/{TINY}:Q4_0") == model.file.path  # `pagelm bench MODEL`
    ran = pagelm("run", f"hf.co/{QWEN}:Q8_0", "Hi", "--max-tokens", "1")
    assert ran.returncode == 0, ran.stderr
    assert "pulling qwen-tiny-Q8_0.gguf" in ran.stderr and (_snapshot(env, QWEN) / "mmproj-F16.gguf").is_file()


def test_serve_a_pulled_hub_model_offline_with_its_tower(hub, env, pagelm):
    assert pagelm("pull", f"hf.co/{QWEN}:Q8_0").returncode == 0
    hub.reset_counts()
    server = ServerProcess(f"hf.co/{QWEN}:Q8_0", "--ctx-len", "2048", "--max-tokens", "4",
                           env={**env, "HF_HUB_OFFLINE": "1"})
    try:
        server.wait_ready()
        assert server.model == f"hf.co/{QWEN}:Q8_0"
        reply = openai_chat(server, png(64, 64))
        assert reply["status"] == 200, reply
        assert reply["usage"]["prompt_tokens"] > 64  # the image's tokens: the tower beside the model was used
    finally:
        server.stop()
    assert hub.requests == []


def test_the_tower_pull_chose_is_used_and_rm_takes_a_tower_no_other_model_uses(hub, env, pagelm):
    assert pagelm("pull", f"hf.co/{QWEN}:Q4_0", "--no-mmproj").returncode == 0
    snapshot = _snapshot(env, QWEN)
    assert not list(snapshot.glob("mmproj*"))
    assert pagelm("pull", f"hf.co/{QWEN}:Q8_0").returncode == 0  # the default: F16
    entries = {e["name"]: e for e in json.loads(pagelm("list", "--json").stdout)}
    assert entries[f"hf.co/{QWEN}:Q4_0"]["tower"] is None  # --no-mmproj is remembered
    assert entries[f"hf.co/{QWEN}:Q8_0"]["tower"]["file"] == "mmproj-F16.gguf"
    _one_line_error(pagelm("pull", f"hf.co/{QWEN}:Q4_0", "--mmproj", "F32"), "no such vision tower",
                    "mmproj-BF16.gguf, mmproj-F16.gguf")
    assert pagelm("pull", f"hf.co/{QWEN}:Q4_0", "--mmproj", "bf16").returncode == 0
    entries = {e["name"]: e for e in json.loads(pagelm("list", "--json").stdout)}
    assert entries[f"hf.co/{QWEN}:Q4_0"]["tower"]["file"] == "mmproj-BF16.gguf"

    removed = pagelm("rm", f"hf.co/{QWEN}:Q8_0")
    assert removed.returncode == 0, removed.stderr
    assert sorted(p.name for p in snapshot.iterdir()) == ["mmproj-BF16.gguf", "qwen-tiny-Q4_0.gguf"]
    assert len(list((snapshot.parents[1] / "blobs").iterdir())) == 2


HOSTILE = "org/hostile"  # what a compromised HF_ENDPOINT answers for it: hub.hostile[HOSTILE]
HOSTILE_COMMIT = hashlib.sha1(b"hostile").hexdigest()


def _tree(root: Path, leaving_out: Path) -> set[tuple[str, bool]]:
    return {(str(p.relative_to(root)), p.is_symlink()) for p in root.rglob("*")
            if leaving_out != p and leaving_out not in p.parents}


def test_a_hostile_listing_writes_nothing_outside_the_cache(hub, hub_files, env, pagelm, tmp_path):
    model, outside = Path(hub_files["tiny-b"]), tmp_path / "outside"
    linked_out = Path(env["HF_HUB_CACHE"]) / f"models--{HOSTILE.replace('/', '--')}" / "snapshots" / HOSTILE_COMMIT
    linked_out.mkdir(parents=True)
    outside.mkdir()
    (linked_out / "sub").symlink_to(outside)  # a folder in the snapshot that leads out of it
    escaping = "../../../../outside/evil-Q8_0.gguf"  # from snapshots/COMMIT/ to tmp_path/outside/
    cases = [
        (Hostile(HOSTILE_COMMIT, {escaping: model}), f"'{escaping}'"),
        (Hostile(HOSTILE_COMMIT, {str(outside / "evil-Q8_0.gguf"): model}), f"'{outside / 'evil-Q8_0.gguf'}'"),
        (Hostile("../../../outside", {"evil-Q8_0.gguf": model}), "commit id '../../../outside'"),
        (Hostile(HOSTILE_COMMIT, {"evil-Q8_0.gguf": model}, sha256="../../../../outside/blob"), "blob id"),
        (Hostile(HOSTILE_COMMIT, {"sub/evil-Q8_0.gguf": model}), "would be stored outside"),
        *[(Hostile(HOSTILE_COMMIT, {bad: model}), "not a path inside a repository")
          for bad in ("a//evil-Q8_0.gguf", "a\\..\\evil-Q8_0.gguf", "a\0/evil-Q8_0.gguf")],
    ]
    before = _tree(tmp_path, leaving_out=Path(env["HF_HUB_CACHE"]))
    for hostile, words in cases:
        hub.hostile[HOSTILE] = hostile
        _one_line_error(pagelm("pull", f"hf.co/{HOSTILE}:Q8_0"), words)
        assert _tree(tmp_path, leaving_out=Path(env["HF_HUB_CACHE"])) == before, words


def test_a_body_longer_than_listed_is_cut_at_the_listed_size(hub, hub_files, env, pagelm):
    size = os.path.getsize(hub_files["tiny-b"])
    hub.faults[(TINY, "tiny-Q4_0.gguf")] = Fault(overlong=64 << 20)
    pulled = pagelm("pull", f"hf.co/{TINY}:Q4_0")
    _one_line_error(pulled, f"more of tiny-Q4_0.gguf than the {size} bytes it lists")
    assert int(re.search(r"stopped reading at (\d+)", pulled.stderr).group(1)) <= size + CHUNK
    # the server counts what the sockets took too (megabytes), never the whole tail
    assert hub.sent[(TINY, "tiny-Q4_0.gguf")] < size + (64 << 20)
    repo = Path(env["HF_HUB_CACHE"]) / f"models--{TINY.replace('/', '--')}"
    assert not list((repo / "blobs").iterdir()) and not (repo / "snapshots").exists()


def test_a_resumed_download_goes_on_from_where_it_asked_or_from_the_start(hub, hub_files, env, pagelm):
    hub.faults[(TINY, "tiny-Q8_0.gguf")] = Fault(drop_at=0.5, range_from=0)  # the resume answered from byte 0
    pulled = pagelm("pull", f"hf.co/{TINY}:Q8_0")
    assert pulled.returncode == 0, pulled.stderr
    assert _sha256(_snapshot(env, TINY) / "tiny-Q8_0.gguf") == _sha256(hub_files["tiny-a2"])
    assert [r[2] is not None for r in hub.requests if r[0] == "GET"] == [False, True]

    hub.faults[(TINY, "tiny-Q4_0.gguf")] = Fault(drop_at=0.5, range_from=1)  # from neither
    _one_line_error(pagelm("pull", f"hf.co/{TINY}:Q4_0"), "tiny-Q4_0.gguf", "Content-Range 'bytes 1-")
    assert not list((_snapshot(env, TINY).parents[1] / "blobs").glob("*.incomplete"))


def test_a_name_without_a_quant_means_what_pull_chose_for_it(hub, env, pagelm):
    assert pagelm("pull", f"hf.co/{TINY}:Q4_0").returncode == 0
    # pull would choose Q8_0 (the default), which the cache lacks: not the Q4_0 that is there
    _one_line_error(pagelm("run", f"hf.co/{TINY}", "Hi", extra={"HF_HUB_OFFLINE": "1"}), "names no quant",
                    "the cache holds Q4_0")
    pulled = pagelm("pull", f"hf.co/{TINY}")
    assert pulled.returncode == 0 and "tiny-Q8_0.gguf" in pulled.stdout, pulled.stderr
    removed = pagelm("rm", f"hf.co/{TINY}", extra={"HF_HUB_OFFLINE": "1"})
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.strip() == f"removed {_snapshot(env, TINY) / 'tiny-Q8_0.gguf'}"


_ADD_LOCAL = """
import sys
from pagelm.sources import store
print("ready", flush=True)
sys.stdin.readline()  # the other process is ready too
for path in sys.argv[1:]:
    store.add_local(path)
"""


def test_concurrent_processes_lose_no_record(env, tmp_path):
    models = [tmp_path / f"m{i}.gguf" for i in range(200)]
    for path in models:
        path.write_bytes(b"GGUF")
    halves = [models[:100], models[100:]]
    processes = [subprocess.Popen([sys.executable, "-c", _ADD_LOCAL, *map(str, half)], env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for half in halves]
    for process in processes:
        assert process.stdout.readline() == "ready\n"
    for process in processes:
        process.stdin.write("go\n")
        process.stdin.flush()
    for process in processes:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
    recorded = json.loads((Path(env["PAGELM_HOME"]) / "local-models.json").read_text())
    assert recorded == {path.stem: str(path.resolve()) for path in models}


def test_two_pulls_of_one_model_at_once_both_succeed(hub, hub_files, env, pagelm):
    held = hub.faults[(QWEN, "qwen-tiny-Q8_0.gguf")] = Fault(hold_at=0.5)
    pulls = [subprocess.Popen([sys.executable, "-m", "pagelm", "pull", f"hf.co/{QWEN}:Q8_0"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    try:
        while hub.sent.get((QWEN, "qwen-tiny-Q8_0.gguf"), 0) < os.path.getsize(hub_files["qwen-Q8_0"]) // 2:
            assert all(p.poll() is None for p in pulls)
            time.sleep(0.05)
    finally:
        held.released.set()
    for process in pulls:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
    snapshot = _snapshot(env, QWEN)
    assert _sha256(snapshot / "qwen-tiny-Q8_0.gguf") == _sha256(hub_files["qwen-Q8_0"])
    assert _sha256(snapshot / "mmproj-F16.gguf") == _sha256(hub_files["mmproj-F16"])
    assert sorted(p.name for p in snapshot.iterdir()) == ["mmproj-F16.gguf", "qwen-tiny-Q8_0.gguf"]
    assert hub.sent[(QWEN, "qwen-tiny-Q8_0.gguf")] == os.path.getsize(hub_files["qwen-Q8_0"])  # fetched once
