"""Checks every mixture-of-experts architecture's tests share: routes recorded per layer, batched
decode of sequences that share and part experts against each alone, and a restored checkpoint and
prefix-cache entry against recomputing."""

from __future__ import annotations

import numpy as np

from pagelm.models.moe import mixtures
from pagelm.serve.prefix_cache import PrefixCache


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def routes(model) -> list[list]:
    """Per layer, the list its mixture appends each call's expert choices to, from now on."""
    found = mixtures(model.network)
    for experts in found:
        experts.routes = []
    return [experts.routes for experts in found]


def check_sharing_and_parting(model, prompt: list[int]) -> None:
    """Four sequences decoded together five steps, their experts shared and parted somewhere, each
    row the bits of its sequence decoded alone."""
    prompts = [prompt, prompt[:4], [9, 200], [77]]
    batched, alone = ([model.session(32) for _ in prompts] for _ in range(2))
    for b, a, p in zip(batched, alone, prompts):
        b.prefill(p)
        a.prefill(p)
    layers = routes(model)
    shared = parted = False
    for _ in range(5):
        tokens = [int(np.argmax(s.logits)) for s in alone]
        before = len(layers[0])
        rows = model.decode_batch(batched, tokens)
        for calls in layers:  # the batched call's choices per layer: is an expert shared, a pair disjoint?
            sets = [set(r) for r in calls[before].tolist()]
            pairs = [(a, b) for i, a in enumerate(sets) for b in sets[i + 1 :]]
            shared |= any(a & b for a, b in pairs)
            parted |= any(not a & b for a, b in pairs)
        for row, session, token in zip(rows, alone, tokens):
            assert same_bits(row, session.decode(token))
    assert shared and parted


def check_restores(model, prompt: list[int], detour: list[int], tokens: tuple[int, ...] = (9, 99, 199)) -> None:
    """A session brought back from `detour` by its checkpoint, and one the prefix cache restores the
    prompt into, decode the bits of a session that computed the prompt itself."""
    session, fresh = model.session(64), model.session(64)
    session.prefill(prompt)
    checkpoint = session.checkpoint()
    cache = PrefixCache(slots=2, max_bytes=1 << 24)
    entry = cache.store(session, whole=True)
    session.prefill(detour)
    session.decode(6)
    session.restore(checkpoint)
    restored = model.session(64)
    restored.prefill([11, 12, 13])
    cache.restore(entry, restored)
    assert same_bits(session.logits, fresh.prefill(prompt))
    for token in tokens:
        want = fresh.decode(token)
        assert same_bits(session.decode(token), want) and same_bits(restored.decode(token), want)


def check_routes(model, reference, prompt: list[int], softmax_first: bool = True, layers: int | None = None) -> None:
    """The prompt's tokens and 8 greedy ones go to transformers' top-k experts (`reference`'s router
    logits: the top-k of their softmax, or of the logits themselves), in its order, every layer."""
    import torch
    from hf_oracle import greedy

    chosen = routes(model)
    tokens, _ = greedy(model, prompt, steps=8)
    ids = prompt + tokens  # greedy decodes each token it picks
    with torch.inference_mode():
        logits = reference(torch.tensor([ids]), output_router_logits=True).router_logits
    k = reference.config.num_experts_per_tok
    assert len(logits) == len(chosen) and (layers is None or len(chosen) == layers)
    for layer, (ours, theirs) in enumerate(zip(chosen, logits)):
        theirs = theirs.float()
        want = torch.topk(torch.softmax(theirs, -1) if softmax_first else theirs, k, -1).indices
        got = torch.cat(ours)
        assert got.shape == want.shape == (len(ids), k)
        assert torch.equal(got, want), f"layer {layer}"
    assert len({tuple(r) for r in torch.cat(chosen[0]).tolist()}) > 3  # the tokens do not all go one way


def changed_directory(source, tmp_path, change: dict):
    """A copy of the checkpoint directory `source` with `change` merged into its config.json."""
    import json
    import shutil

    directory = tmp_path / "changed"
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    return directory
