"""The mmproj GGUF: what write_mmproj writes as gguf-py (llama.cpp's own constants) reads it, the
real geometries' sizes, and files that are not a Qwen3.5 tower or contradict themselves, each
refused with an error naming the file and the key or tensor."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from pagelm.errors import ModelFormatError, PagelmError, UnsupportedError
from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant import GGMLType
from pagelm.tools.synth import plan_nbytes, tensor_chunks
from pagelm.tools.synth_tower import SHAPES, plan_mmproj, write_mmproj
from pagelm.vision import VisionConfig, VisionTower
from pagelm.tools.synth_tower import mmproj_metadata
from pagelm.weights.loader import WeightLoader

TINY = SHAPES["qwen3.5-tiny"]


def _fields(reader: gguf.GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def test_gguf_py_reads_what_llama_cpp_expects(tmp_path):
    path = str(tmp_path / "mmproj.gguf")
    write_mmproj(path, TINY, seed=5)
    reader = gguf.GGUFReader(path)
    fields, K = _fields(reader), gguf.Keys
    assert fields["general.architecture"] == "clip" and fields["general.type"] == gguf.GGUFType.MMPROJ
    assert fields[K.Clip.PROJECTOR_TYPE] == gguf.VisionProjectorType.QWEN3VL
    assert fields[K.Clip.HAS_VISION_ENCODER] is True and fields[K.ClipVision.USE_GELU] is True
    expected = {
        K.ClipVision.BLOCK_COUNT: 2, K.ClipVision.EMBEDDING_LENGTH: 64, K.ClipVision.FEED_FORWARD_LENGTH: 128,
        K.ClipVision.Attention.HEAD_COUNT: 4, K.ClipVision.PROJECTION_DIM: 128, K.ClipVision.PATCH_SIZE: 16,
        K.ClipVision.SPATIAL_MERGE_SIZE: 2, K.ClipVision.IMAGE_SIZE: 768,
    }
    for key, value in expected.items():
        assert fields[key] == value, key
        assert reader.fields[key].types == [gguf.GGUFValueType.UINT32], key
    assert fields[K.ClipVision.Attention.LAYERNORM_EPS] == pytest.approx(1e-6)
    assert fields[K.ClipVision.IMAGE_MEAN] == fields[K.ClipVision.IMAGE_STD] == [0.5, 0.5, 0.5]
    assert fields[K.ClipVision.IS_DEEPSTACK_LAYERS] == [False, False]

    names = {t.name: t for t in reader.tensors}
    T, N = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    block = [N[t] for t in (T.V_ENC_INPUT_NORM, T.V_ENC_POST_ATTN_NORM, T.V_ENC_ATTN_QKV, T.V_ENC_ATTN_O,
                            T.V_ENC_FFN_UP, T.V_ENC_FFN_DOWN)]
    stems = [N[T.V_POST_NORM], N[T.V_MMPROJ].format(bid=0), N[T.V_MMPROJ].format(bid=2)]
    stems += [s.format(bid=i) for i in range(2) for s in block]
    wanted = {f"{s}.{part}" for s in stems for part in ("weight", "bias")}
    patch = N[T.V_ENC_EMBD_PATCH]
    wanted |= {f"{patch}.weight", f"{patch}.weight.1", f"{patch}.bias", f"{N[T.V_ENC_EMBD_POS]}.weight"}
    assert set(names) == wanted
    for name, t in names.items():
        is_matrix = name.endswith("weight") and len(t.shape) >= 2 or name.endswith("weight.1")
        assert t.tensor_type == (gguf.GGMLQuantizationType.F16 if is_matrix else gguf.GGMLQuantizationType.F32), name
    assert list(names[f"{patch}.weight.1"].shape) == [16, 16, 3, 64]  # ggml order, ne0 first
    assert list(names["v.position_embd.weight"].shape) == [64, 2304]
    assert list(names["mm.0.weight"].shape) == [256, 256] and list(names["mm.2.weight"].shape) == [256, 128]


def test_seeded_and_written_through_part_file(tmp_path):
    paths = [str(tmp_path / f"{i}.gguf") for i in range(3)]
    for path, seed in zip(paths, (1, 1, 2)):
        written = []
        plan = write_mmproj(path, TINY, seed=seed, progress=written.append)
        assert sum(written) == plan_nbytes(plan) and len(written) >= len(plan)
    data = [open(p, "rb").read() for p in paths]
    assert data[0] == data[1] != data[2]
    bad = str(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match="mm.0.weight"):
        write_mmproj(bad, TINY, values={"mm.0.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match="v.nothing"):
        write_mmproj(bad, TINY, values={"v.nothing": np.zeros(3, np.float32)})
    assert sorted(os.listdir(tmp_path)) == ["0.gguf", "1.gguf", "2.gguf"]  # no .part left behind


@pytest.mark.parametrize("shape, millions", [("qwen3.5-0.8b", 101), ("qwen3.5-2b", 331), ("qwen3.5-4b", 334),
                                             ("qwen3.5-9b", 456)])
def test_real_geometries_have_transformers_parameter_counts(shape, millions):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from vision_hf import hf_config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    with torch.device("meta"):
        reference = sum(p.numel() for p in Qwen3_5VisionModel(hf_config(SHAPES[shape])).parameters())
    count = sum(int(np.prod(t.dims)) for t in plan_mmproj(SHAPES[shape]))
    assert count == reference and round(count / 1e6) == millions  # vision.md's "~N M"


def test_config_read_back(tmp_path):
    path = str(tmp_path / "mmproj.gguf")
    config = SHAPES["qwen3.5-tiny-k"]
    write_mmproj(path, config, matrix_type=GGMLType.BF16)
    read = VisionConfig.from_loader(WeightLoader.open(path))
    assert read == VisionConfig(**{**config.__dict__, "layer_norm_eps": read.layer_norm_eps})
    assert read.layer_norm_eps == pytest.approx(1e-6)


def _write(path: str, metadata_changes: dict, tensors_of: VisionConfig = TINY, drop: str | None = None) -> str:
    """An mmproj of TINY's metadata with `metadata_changes` (None removes a key), holding the
    tensors of `tensors_of` except `drop`."""
    metadata = {k: v for k, v in {**mmproj_metadata(TINY), **metadata_changes}.items() if v is not None}
    plan = [t for t in plan_mmproj(tensors_of) if t.name != drop]
    write_gguf(path, metadata, [TensorToWrite(t.name, t.dims, t.ggml_type, tensor_chunks(t, 0)) for t in plan])
    return path


def _u32(v: int) -> Typed:
    return Typed(GGUFValueType.UINT32, v)


BROKEN = [
    ("text model", {"general.architecture": "qwen35"}, None, None, ModelFormatError,
     "'general.architecture' is 'qwen35', expected 'clip'"),
    ("other projector", {"clip.projector_type": "mlp"}, None, None, UnsupportedError, "'clip.projector_type' is 'mlp'"),
    ("no vision encoder", {"clip.has_vision_encoder": False}, None, None, ModelFormatError, "has_vision_encoder"),
    ("deepstack", {"clip.vision.is_deepstack_layers": [True, False]}, None, None, UnsupportedError, "deepstack"),
    ("heads", {"clip.vision.attention.head_count": _u32(5)}, None, None, ModelFormatError,
     "embedding_length 64 is not a multiple of the head count 5"),
    ("head dim", {"clip.vision.attention.head_count": _u32(32)}, None, None, ModelFormatError,
     "head dim 2 is not a multiple of 4"),
    ("ffn size", {"clip.vision.feed_forward_length": _u32(96)}, None, None, ModelFormatError,
     "'v.blk.0.ffn_up.weight' has shape \\(128, 64\\).*expected \\(96, 64\\)"),
    ("out size", {"clip.vision.projection_dim": _u32(100)}, None, None, ModelFormatError, "'mm.2.weight'"),
    ("width", {}, VisionConfig(depth=2, hidden=32, heads=4, intermediate=128, out_hidden=128), None,
     ModelFormatError, "'v.position_embd.weight' has dims \\(32, 2304\\).*expected \\(64"),
    ("missing tensor", {}, None, "v.blk.1.attn_out.bias", ModelFormatError, "'v.blk.1.attn_out.bias' missing"),
    ("depth", {"clip.vision.block_count": _u32(3)}, None, None, ModelFormatError, "'v.blk.2.ln1.weight' missing"),
    ("mean", {"clip.vision.image_mean": [0.5, 0.5]}, None, None, ModelFormatError, "image_mean"),
    ("missing key", {"clip.vision.patch_size": None}, None, None, ModelFormatError, "'clip.vision.patch_size' missing"),
]


@pytest.mark.parametrize("label, changes, tensors_of, drop, error, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_files_refused(tmp_path, label, changes, tensors_of, drop, error, message):
    path = _write(str(tmp_path / f"{label}.gguf"), changes, tensors_of or TINY, drop)
    with pytest.raises(error, match=message) as caught:
        VisionTower.load(WeightLoader.open(path))
    assert path in str(caught.value)
    assert isinstance(caught.value, PagelmError)
