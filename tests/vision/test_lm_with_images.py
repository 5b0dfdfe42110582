"""A Qwen3.5 language model reading images, against transformers' `Qwen3_5ForConditionalGeneration`
in float32: a tiny random text model (the real 248,320-token vocabulary, so the image token ids
exist) written as a GGUF, its tower as the mmproj found beside it. M-RoPE positions against
`get_rope_index`, the logits with two images of different shapes, greedy decoding, checkpoints
carrying the position offset, and text through the M-RoPE path bit for bit today's rope."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

import pagelm
from pagelm.engine.load import find_mmproj
from pagelm.errors import PagelmError, UnsupportedError
from pagelm.models.qwen35 import mrope_axes, mrope_positions
from pagelm.quant import GGMLType
from pagelm.engine.sampling import SamplingParams
from pagelm.serve.prefix_cache import PrefixCache
from pagelm.tools.synth_tower import write_mmproj
from pagelm.vision import VisionConfig
from pagelm.vision.inputs import IMAGE_PAD, VISION_END, VISION_START, ImageInput, prepare_image

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration  # noqa: E402
from vision_hf import hf_config as hf_vision_config  # noqa: E402
from vision_hf import hf_to_gguf as tower_values  # noqa: E402
from vision_hf import random_hf_model  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))  # the text model's twin
from qwen35_hf import Variant, build_hf_model, hf_to_gguf  # noqa: E402

REL_TOL = 1e-3
STEPS = 16
TEXT = Variant("vision", hidden=64, layers=4, interval=2, ffn=128, heads=4, kv_heads=2, head_dim=64,
               partial_rotary=0.25, rope_theta=1e7, key_heads=2, value_heads=4, linear_dim=16, vocab=248_320,
               mrope_section=(3, 3, 2))  # 8 rope frequency pairs: t h w t h w t h
TOWER = VisionConfig(depth=2, hidden=32, heads=2, intermediate=64, out_hidden=TEXT.hidden)
# (width, height): merged grids of 2 × 5 and 4 × 2 tokens, so that max(rows, columns) != rows · columns
IMAGE_SIZES = ((160, 64), (64, 128))


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()


@dataclass
class Twins:
    hf: Qwen3_5ForConditionalGeneration
    model: pagelm.engine.Model
    images: list[ImageInput]
    ids: list[int]

    def hf_inputs(self) -> dict:
        ids = torch.tensor([self.ids])
        rows = [image.rows() for image in self.images]
        return {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE_PAD).int(),
                "pixel_values": torch.from_numpy(np.concatenate([r.rows for r in rows])),
                "image_grid_thw": torch.tensor([r.grid for r in rows])}


def _prompt(images: list[ImageInput], seed: int = 3) -> list[int]:
    """Text, an image, text, an image, text: random ids below the special tokens."""
    rng = np.random.default_rng(seed)
    text = lambda n: rng.integers(0, 248_000, n).tolist()  # noqa: E731
    ids = text(7)
    for image, n_after in zip(images, (5, 6)):
        ids += [VISION_START] + [IMAGE_PAD] * image.tokens + [VISION_END] + text(n_after)
    return ids


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> Twins:
    root = tmp_path_factory.mktemp("vision-lm")
    text = build_hf_model(TEXT, seed=1)
    tower = random_hf_model(TOWER, seed=2)
    hf_to_gguf(text, str(root / "model.gguf"))
    write_mmproj(str(root / "mmproj-model.gguf"), TOWER, values=tower_values(tower), matrix_type=GGMLType.F32)

    config = Qwen3_5Config(text_config=text.config.to_dict(), vision_config=hf_vision_config(TOWER).to_dict(),
                           tie_word_embeddings=True)
    hf = Qwen3_5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        hf.model.language_model.load_state_dict(text.model.state_dict())
        hf.model.visual.load_state_dict(tower.state_dict())
        hf.lm_head.weight.copy_(text.lm_head.weight)
    model = pagelm.load(str(root / "model.gguf"), dtype="float32")  # the mmproj beside it
    images = [prepare_image(_png(w, h, seed=i), model.tower.config, min_tokens=4, max_tokens=64)
              for i, (w, h) in enumerate(IMAGE_SIZES)]
    return Twins(hf, model, images, _prompt(images))


def _rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _spans(ids: list[int], images: list[ImageInput]) -> list[tuple[int, int, int]]:
    starts = [i for i, t in enumerate(ids) if t == IMAGE_PAD and ids[i - 1] == VISION_START]
    return [(start, *image.merged) for start, image in zip(starts, images)]


def test_images_have_the_grids_the_test_needs(twins):
    assert [image.merged for image in twins.images] == [(2, 5), (4, 2)]
    assert twins.model.mmproj.endswith("mmproj-model.gguf")


def test_positions_are_transformers_rope_index(twins):
    inputs = twins.hf_inputs()
    ref, delta = twins.hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               inputs["image_grid_thw"])
    positions, after = mrope_positions(0, len(twins.ids), _spans(twins.ids, twins.images))
    assert torch.equal(positions, ref[:, 0])
    assert after - len(twins.ids) == delta.item() == 5 - 10 + 4 - 8
    # the same from any starting position, as a later prefill or a restored state starts
    shifted, _ = mrope_positions(100, len(twins.ids), _spans(twins.ids, twins.images))
    assert torch.equal(shifted, ref[:, 0] + 100)


def test_rope_axes_interleave_the_sections():
    assert mrope_axes((11, 11, 10), 32).tolist() == [0, 1, 2] * 10 + [0, 1]
    assert mrope_axes((3, 3, 2), 8).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_axes((), 8).tolist() == [0] * 8


def test_logits_and_greedy_tokens_match_transformers(twins):
    inputs = twins.hf_inputs()
    with torch.no_grad():
        ref = twins.hf(**inputs).logits[0]
        generated = twins.hf.generate(**inputs, max_new_tokens=STEPS, do_sample=False, eos_token_id=None)
    session = twins.model.session(256)
    # prefill cut after the first image's end token: the second piece starts at an offset position
    cut = twins.ids.index(VISION_END) + 1
    first = session.prefill(twins.ids[:cut], twins.images[:1])
    assert _rel(first, ref[cut - 1]) < REL_TOL
    last = session.prefill(twins.ids[cut:], twins.images[1:])
    assert _rel(last, ref[-1]) < REL_TOL
    assert session.images == [image.key for image in twins.images]
    assert session.position_delta == (5 - 10) + (4 - 8)

    session.reset()
    ours = list(session.generate(twins.ids, SamplingParams(temperature=0.0, max_tokens=STEPS), images=twins.images))
    assert ours == generated[0, len(twins.ids):].tolist()


def test_checkpoint_and_restore_carry_the_position_offset(twins):
    session = twins.model.session(256)
    session.prefill(twins.ids, twins.images)
    checkpoint = session.checkpoint()
    assert checkpoint.position_delta == session.position_delta != 0
    after = [session.decode(t).copy() for t in (11, 12, 13)]
    session.reset()
    assert session.position_delta == 0 and session.images == []
    session.restore(checkpoint)
    assert session.position_delta == checkpoint.position_delta
    assert session.images == list(checkpoint.images)
    again = [session.decode(t) for t in (11, 12, 13)]
    for a, b in zip(after, again):
        assert np.array_equal(a, b)


def test_the_prefix_cache_keys_the_images_and_restores_the_offset(twins):
    cache = PrefixCache(slots=8, max_bytes=1 << 30)
    keys = [image.key for image in twins.images]
    cut = twins.ids.index(VISION_END) + 1
    session = twins.model.session(256)
    session.prefill(twins.ids[:cut], twins.images[:1])
    stored = cache.store(session)
    session.prefill(twins.ids[cut:], twins.images[1:])
    expected = [session.decode(t).copy() for t in (5, 6)]

    assert cache.lookup(twins.ids, [keys[1], keys[1]]) is None  # another image in the first one's place
    other = twins.model.session(256)
    other.prefill([7, 8, 9])
    hit = cache.lookup(twins.ids, keys)
    assert hit is stored and hit.position_delta == 5 - 10
    cache.restore(hit, other)
    assert other.position_delta == 5 - 10 and other.images == keys[:1]
    other.prefill(twins.ids[cut:], twins.images[1:])
    for e, g in zip(expected, [other.decode(t) for t in (5, 6)]):
        assert np.array_equal(e, g)


def test_the_tower_runs_once_per_image(twins):
    cache = twins.model.image_cache
    for _ in range(2):
        session = twins.model.session(256)
        session.prefill(twins.ids, twins.images)
    stats = cache.stats()
    assert stats["entries"] == 2 and stats["hits"] >= 2
    assert stats["bytes_held"] == sum(image.tokens for image in twins.images) * TEXT.hidden * 4


def test_text_through_the_mrope_path_is_plain_rope_bit_for_bit(twins):
    network = twins.model.network
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((40, TEXT.hidden), np.float32))
    plain, mrope = network.new_state(64), network.new_state(64)
    positions, _ = mrope_positions(0, 40, [])
    assert torch.equal(network.forward(x, plain), network.forward(x, mrope, positions))
    assert torch.equal(network.forward(x[:1], plain), network.forward(x[:1], mrope, mrope_positions(40, 1, [])[0]))


def test_pad_runs_must_be_the_images(twins):
    session = twins.model.session(256)
    with pytest.raises(PagelmError, match="image pad tokens in runs of"):
        session.prefill(twins.ids, twins.images[:1])
    assert session.tokens == []
    # without images a pad token is text, as one the model samples is
    session.prefill([IMAGE_PAD, 5, IMAGE_PAD])
    assert session.position_delta == 0


def test_a_tower_is_found_beside_its_model(tmp_path):
    model = tmp_path / "qwen-a.gguf"
    model.write_bytes(b"")
    assert find_mmproj(str(model)) is None
    (tmp_path / "mmproj-F16.gguf").write_bytes(b"")
    assert find_mmproj(str(model)) == str(tmp_path / "mmproj-F16.gguf")
    (tmp_path / "mmproj-qwen-b.gguf").write_bytes(b"")
    with pytest.raises(PagelmError, match="several vision towers"):
        find_mmproj(str(model))
    (tmp_path / "mmproj-qwen-a.gguf").write_bytes(b"")  # the one named after the model
    assert find_mmproj(str(model)) == str(tmp_path / "mmproj-qwen-a.gguf")
    directory = tmp_path / "hf"
    directory.mkdir()
    assert find_mmproj(str(directory)) is None
    (directory / "mmproj.gguf").write_bytes(b"")
    assert find_mmproj(str(directory)) == str(directory / "mmproj.gguf")


def test_a_tower_must_fit_its_model(tmp_path, twins):
    from pagelm.tools.synth import SHAPES, write_model
    from pagelm.tools.synth_tower import SHAPES as TOWERS

    tiny, tower = str(tmp_path / "tiny.gguf"), str(tmp_path / "tower.gguf")
    write_model(tiny, SHAPES["qwen3.5-tiny"])
    write_mmproj(tower, TOWERS["qwen3.5-tiny"])
    with pytest.raises(PagelmError, match="has no image tokens"):
        pagelm.load(tiny, mmproj=tower)
    assert pagelm.load(tiny).tower is None  # mmproj.gguf only counts beside a model in a directory
    wide = str(tmp_path / "wide.gguf")
    write_mmproj(wide, TOWERS["qwen3.5-tiny-k"])
    with pytest.raises(PagelmError, match="not its tower"):
        pagelm.load(os.path.dirname(twins.model.mmproj) + "/model.gguf", mmproj=wide)


def test_a_tower_found_beside_a_model_it_does_not_fit_is_skipped(tmp_path, twins, caplog):
    from pagelm.tools.synth_tower import SHAPES as TOWERS

    (tmp_path / "model.gguf").symlink_to(os.path.dirname(twins.model.mmproj) + "/model.gguf")
    write_mmproj(str(tmp_path / "mmproj-wide.gguf"), TOWERS["qwen3.5-tiny-k"])
    with caplog.at_level(logging.WARNING, logger="pagelm"):
        model = pagelm.load(str(tmp_path / "model.gguf"))
    assert model.tower is None and model.mmproj is None
    assert "text only" in caplog.text and "mmproj-wide.gguf" in caplog.text and "not its tower" in caplog.text
    (tmp_path / "mmproj-another.gguf").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagelm"):
        assert pagelm.load(str(tmp_path / "model.gguf")).tower is None
    assert "several vision towers" in caplog.text


def test_only_qwen35_models_take_a_tower(tmp_path, smollm2_gguf):
    tower = str(tmp_path / "mmproj.gguf")
    write_mmproj(tower, TOWER)
    with pytest.raises(UnsupportedError, match="reads images with qwen35, qwen35moe models"):
        pagelm.load(smollm2_gguf, mmproj=tower)


def test_a_mixture_of_experts_reads_images_as_transformers_does(tmp_path):
    """qwen35moe (Qwen3_5MoeForConditionalGeneration's text model, the MoE member's own rope sections)
    with a tower beside it: the logits of a prompt of text and both images, prefilled in two pieces."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = build_hf_model(dataclasses.replace(TEXT, ffn=0, experts=(4, 2, 32, 48)), seed=1)
    tower = random_hf_model(TOWER, seed=2)
    hf_to_gguf(text, str(tmp_path / "model.gguf"))
    write_mmproj(str(tmp_path / "mmproj-model.gguf"), TOWER, values=tower_values(tower), matrix_type=GGMLType.F32)
    config = Qwen3_5MoeConfig(text_config=text.config.to_dict(), vision_config=hf_vision_config(TOWER).to_dict(),
                              tie_word_embeddings=False)
    hf = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        hf.model.language_model.load_state_dict(text.model.state_dict())
        hf.model.visual.load_state_dict(tower.state_dict())
        hf.lm_head.weight.copy_(text.lm_head.weight)
    model = pagelm.load(str(tmp_path / "model.gguf"), dtype="float32")  # the mmproj beside it
    assert model.loader.architecture == "qwen35moe" and model.tower is not None
    images = [prepare_image(_png(w, h, seed=i), model.tower.config, min_tokens=4, max_tokens=64)
              for i, (w, h) in enumerate(IMAGE_SIZES)]
    twins = Twins(hf, model, images, _prompt(images))
    with torch.no_grad():
        ref = hf(**twins.hf_inputs()).logits[0]
    session = model.session(256)
    cut = twins.ids.index(VISION_END) + 1
    assert _rel(session.prefill(twins.ids[:cut], images[:1]), ref[cut - 1]) < REL_TOL
    assert _rel(session.prefill(twins.ids[cut:], images[1:]), ref[-1]) < REL_TOL
    # the multimodal checkpoint as transformers saves it (text_config, model.language_model.*, model.visual.*)
    # read in place as its text model
    hf.save_pretrained(tmp_path / "hf")
    text_ids = twins.ids[:7]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([text_ids])).logits[0, -1].numpy()
    assert _rel(pagelm.load(str(tmp_path / "hf"), dtype="float32").session(16).prefill(text_ids), want) < 1e-5
