"""Qwen3.5's multi-token-prediction layer against one put together from transformers' own parts
(qwen35_hf.MtpOracle), opened from a GGUF file as llama.cpp writes it and from a checkpoint
directory in place; its drafts, their rollback, and answers that speculation with it never changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qwen35_hf import VARIANTS, build_hf_model, hf_to_gguf, mtp_tensors
from safetensors.torch import load_file, save_file

from pagelm.engine.load import load_model
from pagelm.engine.sampling import SamplingParams
from pagelm.engine.speculate import FirstOf, MtpDraft, Speculator, check_mode
from pagelm.errors import ModelFormatError, PagelmError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

TOL = 1e-5
PROMPT = 24


@pytest.fixture(scope="module")
def trunk_and_mtp():
    hf = build_hf_model(VARIANTS["equal_heads"])
    oracle, tensors = mtp_tensors(hf)
    return hf, oracle, tensors


@pytest.fixture(scope="module")
def gguf_path(trunk_and_mtp, tmp_path_factory) -> str:
    hf, _, tensors = trunk_and_mtp
    path = str(tmp_path_factory.mktemp("mtp") / "model.gguf")
    hf_to_gguf(hf, path, mtp=tensors)
    return path


@pytest.fixture(scope="module")
def hf_dir(trunk_and_mtp, tmp_path_factory) -> str:
    """The checkpoint directory, its MTP tensors beside the trunk's in model.safetensors (transformers
    saves none: its classes drop them)."""
    hf, _, tensors = trunk_and_mtp
    path = tmp_path_factory.mktemp("mtp-hf")
    hf.save_pretrained(path)
    saved = load_file(path / "model.safetensors")
    save_file({**saved, **tensors}, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def trunk_hidden(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]


def oracle_drafts(hf, oracle, context: list[int], count: int) -> list[int]:
    """The MTP layer's greedy guesses after `context` (its last token chosen, not yet fed), computed
    whole by the oracle: pairs (token t + 1, hidden t) of the context, then its own outputs."""
    table = hf.model.embed_tokens.weight
    ids = torch.tensor(context)
    hidden = trunk_hidden(hf, ids[:-1])
    embeddings = table[ids[1:]]
    drafts = []
    for _ in range(count):
        out = oracle(embeddings, hidden)
        drafts.append(int(torch.argmax(out[-1] @ table.T)))
        embeddings = torch.cat((embeddings, table[drafts[-1]][None]))
        hidden = torch.cat((hidden, out[-1:]))
    return drafts


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_the_layer_matches_transformers(source, trunk_and_mtp, gguf_path, hf_dir):
    hf, oracle, _ = trunk_and_mtp
    model = load_model(gguf_path if source == "gguf" else hf_dir, dtype="float32")
    mtp = model.network.mtp
    assert model.config.n_layers == hf.config.num_hidden_layers and model.config.mtp_layers == 1
    ids = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    hidden = trunk_hidden(hf, ids)
    embeddings = hf.model.embed_tokens.weight[ids[1:]].detach()
    want = oracle(embeddings, hidden[:-1])
    inputs = mtp.inputs(embeddings, hidden[:-1])
    whole = mtp.forward(inputs, mtp.new_state(PROMPT))
    assert relative(whole, want) < TOL
    state = mtp.new_state(PROMPT)
    rows = torch.cat([mtp.forward(inputs[t : t + 1], state) for t in range(PROMPT - 1)])
    assert relative(rows, want) < TOL


def test_a_file_with_the_layer_answers_as_the_trunk_alone(trunk_and_mtp, gguf_path, tmp_path):
    hf, _, _ = trunk_and_mtp
    plain = tmp_path / "plain.gguf"
    hf_to_gguf(hf, plain)
    prompt = list(range(5, 5 + PROMPT))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    answers = [list(load_model(str(p), dtype="float32").session(64).generate(prompt, params))
               for p in (gguf_path, plain)]
    assert answers[0] == answers[1]
    assert load_model(str(plain), dtype="float32").network.mtp is None


def test_drafts_follow_the_oracle_across_rewinds(trunk_and_mtp, gguf_path):
    hf, oracle, _ = trunk_and_mtp
    model = load_model(gguf_path, dtype="float32")
    session = model.session(128)
    drafter = MtpDraft.of(session)
    assert MtpDraft.of(session) is drafter
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    token = int(np.argmax(session.prefill(prompt)))
    for wrong in (2, 0, 3):  # a pass keeping 1 of 3 drafts, one keeping all, one keeping none
        context = [*session.tokens, token]
        drafts = drafter.draft(context, PROMPT, 3)
        assert drafts == oracle_drafts(hf, oracle, context, 3)
        fed = [token, *drafts]
        if wrong:
            fed[wrong] = (fed[wrong] + 1) % hf.config.vocab_size
        rows = session.verify(fed)
        kept = wrong or len(fed)
        session.rewind(kept)
        token = int(np.argmax(rows[kept - 1]))
    assert session.hidden.shape[0] <= 1 + MtpDraft.MOST  # read rows are dropped
    session.reset()  # another conversation: the layer's cache starts over
    prompt = prompt[::-1]
    token = int(np.argmax(session.prefill(prompt)))
    assert drafter.draft([*session.tokens, token], PROMPT, 2) == oracle_drafts(hf, oracle, [*prompt, token], 2)


@pytest.mark.parametrize("temperature,dtype,weights", [(0.0, "float32", "mapped"), (0.8, "bfloat16", "mapped-int8")])
def test_speculating_with_it_changes_no_answer(temperature, dtype, weights, gguf_path):
    model = load_model(gguf_path, dtype=dtype, weights=weights)
    prompt = [3, 9, 27, 81, 243, 217, 139, 417, 3, 9, 27, 81]
    params = SamplingParams(max_tokens=40, temperature=temperature, seed=11)
    plain = list(model.session(128).generate(prompt, params))
    speculator = Speculator.of("mtp", session=(session := model.session(128)))
    assert list(session.generate(prompt, params, speculate=speculator)) == plain
    assert speculator.stats.drafted > 0 and session.mtp_draft.state.pos <= len(session.tokens) + MtpDraft.MOST


def test_clear_errors(trunk_and_mtp, tmp_path):
    hf, _, tensors = trunk_and_mtp
    plain = tmp_path / "plain.gguf"
    hf_to_gguf(hf, plain)
    model = load_model(str(plain), dtype="float32")
    with pytest.raises(PagelmError, match="no multi-token-prediction layer"):
        check_mode("mtp", model)
    with pytest.raises(PagelmError, match="no multi-token-prediction layer"):
        list(model.session(64).generate([1, 2, 3], SamplingParams(max_tokens=2), speculate="mtp"))
    with pytest.raises(PagelmError, match="expected one of"):
        check_mode("eagle", model)
    missing = tmp_path / "missing.gguf"
    hf_to_gguf(hf, missing, mtp=tensors, drop_tensors=(f"blk.{hf.config.num_hidden_layers}.nextn.eh_proj.weight",))
    with pytest.raises(ModelFormatError, match="nextn.eh_proj"):
        load_model(str(missing), dtype="float32")
    too_many = tmp_path / "too_many.gguf"
    hf_to_gguf(hf, too_many, mtp=tensors, nextn=hf.config.num_hidden_layers + 1)
    with pytest.raises(ModelFormatError, match="nextn_predict_layers"):
        load_model(str(too_many), dtype="float32")


def test_auto_drafts_from_lookup_then_the_layer_at_what_they_cost(gguf_path):
    model = load_model(gguf_path, dtype="float32")
    prompt = [3, 9, 27, 81, 243, 217, 139, 417, 3, 9, 27, 81]
    params = SamplingParams(max_tokens=40)
    plain = list(model.session(128).generate(prompt, params))
    speculator = Speculator.of("auto", session=(session := model.session(128)))
    assert isinstance(speculator.source, FirstOf) and speculator.source.sources[1] is session.mtp_draft
    assert list(session.generate(prompt, params, speculate=speculator)) == plain
    assert speculator.stats.drafted > 0 and speculator.costs.per_draft > 0


def test_a_mixture_of_experts_layer_matches_transformers(tmp_path):
    """Qwen3.5-35B-A3B's MTP layer has the trunk's experts and shared expert."""
    from test_qwen35moe import SEED, TINY

    hf = build_hf_model(TINY, seed=SEED)
    oracle, tensors = mtp_tensors(hf, seed=SEED)
    path = str(tmp_path / "moe-mtp.gguf")
    hf_to_gguf(hf, path, mtp=tensors)
    model = load_model(path, dtype="float32")
    mtp = model.network.mtp
    assert model.config.is_moe and model.config.n_layers == TINY.layers
    ids = torch.randint(0, TINY.vocab, (PROMPT,), generator=torch.Generator().manual_seed(3))
    hidden = trunk_hidden(hf, ids)
    embeddings = hf.model.embed_tokens.weight[ids[1:]].detach()
    want = oracle(embeddings, hidden[:-1])
    assert relative(mtp.forward(mtp.inputs(embeddings, hidden[:-1]), mtp.new_state(PROMPT)), want) < TOL
    params = SamplingParams(max_tokens=16)
    plain = list(model.session(64).generate(ids.tolist(), params))
    assert list(model.session(64).generate(ids.tolist(), params, speculate="mtp")) == plain
