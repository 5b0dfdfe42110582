"""Token embedding modes: mapped rows bit-identical to the dense table and to gguf-py, page hints."""

import mmap
import tracemalloc

import gguf.quants
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelm.errors import PagelmError, UnsupportedError
from pagelm.formats.gguf import GGUFFile, TensorToWrite, write_gguf
from pagelm.quant.types import GGMLType, row_nbytes
from pagelm.tools.synth import SYNTH_TYPES, Shape, random_rows, write_embedding_model
from pagelm.weights import DenseTable, MappedRows, MappedTensor, OutputHead, load_token_embedding, page_spans

PAGE = mmap.PAGESIZE


def _tiny_model(tmp_path, ggml_type=GGMLType.Q8_0, vocab=300, dim=512, output_type=None):
    path = str(tmp_path / f"tiny-{ggml_type.name}.gguf")
    write_embedding_model(path, Shape(vocab, dim, ggml_type, output_type), seed=7)
    return path


def _pages(starts, lengths):
    return {p for s, n in zip(starts.tolist(), lengths.tolist()) for p in range(s // PAGE, (s + n) // PAGE)}


@settings(max_examples=300)
@given(
    offset=st.integers(0, 5 * PAGE),
    row_nbytes=st.sampled_from([34, 210, 1088, 2176, 4096, 8192, 8704]),
    rows=st.lists(st.integers(0, 2000), max_size=60),
)
def test_page_spans_cover_exactly_the_touched_pages_coalesced(offset, row_nbytes, rows):
    starts, lengths = page_spans(offset, row_nbytes, np.array(rows, np.int64))
    touched = {p for r in rows for p in range((offset + r * row_nbytes) // PAGE,
                                              (offset + (r + 1) * row_nbytes - 1) // PAGE + 1)}
    assert _pages(starts, lengths) == touched
    assert np.all(starts % PAGE == 0) and np.all(lengths % PAGE == 0) and np.all(lengths > 0)
    ends = starts + lengths
    assert np.all(starts[1:] > ends[:-1])  # sorted, disjoint and never adjacent (else coalesced)


@pytest.mark.parametrize("ggml_type", sorted(SYNTH_TYPES), ids=lambda t: t.name)
def test_mapped_rows_equal_dense_and_gguf_oracle(tmp_path, ggml_type):
    with GGUFFile.open(_tiny_model(tmp_path, ggml_type)) as model:
        dense = load_token_embedding(model, "dense")
        mapped = load_token_embedding(model, "mapped")
        assert isinstance(dense, DenseTable) and isinstance(mapped, MappedRows)
        ids = np.random.default_rng(1).integers(0, 300, 1500)  # > one decode chunk, with repeats
        got = mapped.lookup(ids)
        assert got.dtype == np.uint16 and got.shape == (1500, 512)
        assert np.array_equal(got, dense.lookup(ids))
        raw = np.ascontiguousarray(mapped.tensor.raw)
        oracle = gguf.quants.quantize(gguf.quants.dequantize(raw, ggml_type), gguf.GGMLQuantizationType.BF16)
        assert np.array_equal(got, oracle.view(np.uint16)[ids])
        assert np.array_equal(mapped.lookup(5), dense.lookup([5]))
        del dense, mapped, got


def test_dense_unpacks_into_anonymous_memory_and_mapped_does_not(tmp_path):
    with GGUFFile.open(_tiny_model(tmp_path, GGMLType.BF16, vocab=4096, dim=256)) as model:
        table_bytes = 4096 * 256 * 2
        for mode, check in (("mapped", lambda n: n < table_bytes // 8), ("dense", lambda n: n >= table_bytes)):
            tracemalloc.start()
            embedding = load_token_embedding(model, mode)
            allocated = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            assert check(allocated), (mode, allocated)
            del embedding


def test_float_table_rows_come_straight_from_the_map(tmp_path):
    with GGUFFile.open(_tiny_model(tmp_path, GGMLType.BF16)) as model:
        mapped = load_token_embedding(model, "mapped")
        assert np.shares_memory(mapped.tensor.raw, model.tensor_data("token_embd.weight"))
        stored = model.tensor_data("token_embd.weight").view(np.uint16).reshape(300, 512)
        assert np.array_equal(mapped.lookup([3, 299, 0]), stored[[3, 299, 0]])
        del mapped, stored


class _RecordingMap:
    def __init__(self):
        self.calls = []

    def madvise(self, advice, start, length):
        self.calls.append((advice, start, length))


def test_the_head_restores_normal_readahead_on_a_tied_table_then_asks_for_all_of_it(tmp_path):
    with GGUFFile.open(_tiny_model(tmp_path, vocab=3000)) as model:
        tensor = MappedTensor(model, "token_embd.weight")
        tensor._map = recorder = _RecordingMap()
        MappedRows(tensor)
        OutputHead(tensor)
        assert [call[0] for call in recorder.calls] == [mmap.MADV_RANDOM, mmap.MADV_NORMAL, mmap.MADV_WILLNEED]
        assert len({call[1:] for call in recorder.calls}) == 1  # all over the whole table
        del tensor


def test_mapped_advises_random_and_prefetches_the_prompt_spans(tmp_path):
    with GGUFFile.open(_tiny_model(tmp_path, vocab=3000)) as model:
        tensor = MappedTensor(model, "token_embd.weight")
        tensor._map = recorder = _RecordingMap()
        mapped = MappedRows(tensor)
        assert recorder.calls[0][0] == mmap.MADV_RANDOM
        first_page = tensor.offset // PAGE * PAGE
        assert recorder.calls[0][1] == first_page
        assert recorder.calls[0][1] + recorder.calls[0][2] >= tensor.offset + 3000 * tensor.row_nbytes
        recorder.calls.clear()
        prompt = [2999, 5, 6, 5, 1500, 7]
        mapped.prefetch(prompt)
        starts, lengths = page_spans(tensor.offset, tensor.row_nbytes, np.array(prompt))
        assert recorder.calls == [(mmap.MADV_WILLNEED, s, n) for s, n in zip(starts.tolist(), lengths.tolist())]
        assert len(recorder.calls) == 3  # rows 5,6,7 share pages; 1500 and 2999 stand alone
        del tensor, mapped


def test_prefetch_on_a_real_map_succeeds(tmp_path):
    with GGUFFile.open(_tiny_model(tmp_path)) as model:
        mapped = load_token_embedding(model)
        mapped.prefetch(np.arange(300))
        mapped.prefetch([])
        del mapped


@pytest.mark.parametrize("ids", [[300], [-1], [0, 1, 10**9]])
def test_out_of_range_token_ids_are_rejected(tmp_path, ids):
    with GGUFFile.open(_tiny_model(tmp_path)) as model:
        for mode in ("mapped", "dense"):
            embedding = load_token_embedding(model, mode)
            with pytest.raises(PagelmError, match="out of range for vocabulary of 300"):
                embedding.lookup(ids)
            with pytest.raises(PagelmError, match="1-D sequence of integers"):
                embedding.lookup([0.5])
            del embedding


def test_bad_mode_missing_table_and_undecodable_type(tmp_path):
    with GGUFFile.open(_tiny_model(tmp_path)) as model:
        with pytest.raises(PagelmError, match="embedding must be one of mapped, dense"):
            load_token_embedding(model, "copy")
    no_table = str(tmp_path / "no-table.gguf")
    write_gguf(no_table, {"general.architecture": "qwen35"},
               [TensorToWrite("output.weight", (32, 4), GGMLType.Q8_0, [bytes(4 * 34)])])
    with GGUFFile.open(no_table) as model, pytest.raises(PagelmError, match="token_embd.weight' not found"):
        load_token_embedding(model)
    q2k = str(tmp_path / "q2k.gguf")
    write_gguf(q2k, {}, [TensorToWrite("token_embd.weight", (256, 2), GGMLType.Q2_K,
                                       [bytes(2 * row_nbytes(GGMLType.Q2_K, 256))])])
    with GGUFFile.open(q2k) as model, pytest.raises(UnsupportedError, match="Q2_K"):
        load_token_embedding(model)


def test_random_rows_are_seeded():
    a = random_rows(np.random.default_rng(3), 4, 256, GGMLType.Q6_K)
    b = random_rows(np.random.default_rng(3), 4, 256, GGMLType.Q6_K)
    c = random_rows(np.random.default_rng(4), 4, 256, GGMLType.Q6_K)
    assert a.shape == (4, 210) and np.array_equal(a, b) and not np.array_equal(a, c)


def test_untied_layout_embeds_from_token_embd_not_the_head(tmp_path):
    path = _tiny_model(tmp_path, GGMLType.BF16, output_type=GGMLType.Q8_0)
    with GGUFFile.open(path) as model:
        assert model.tensors["output.weight"].ggml_type == GGMLType.Q8_0
        mapped = load_token_embedding(model)
        assert mapped.tensor.ggml_type == GGMLType.BF16
        assert not np.array_equal(model.tensor_data("output.weight")[:64], model.tensor_data("token_embd.weight")[:64])
        del mapped


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.BF16], ids=lambda t: t.name)
def test_float32_rows_are_identical_in_both_modes_and_exact(tmp_path, ggml_type):
    with GGUFFile.open(_tiny_model(tmp_path, ggml_type)) as model:
        dense = load_token_embedding(model, "dense", rows="f32")
        mapped = load_token_embedding(model, "mapped", rows="f32")
        ids = np.random.default_rng(2).integers(0, 300, 1500)
        got = mapped.lookup(ids)
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), dense.lookup(ids).view(np.uint32))
        oracle = gguf.quants.dequantize(np.ascontiguousarray(mapped.tensor.raw), ggml_type)
        assert np.array_equal(got.view(np.uint32), oracle[ids].view(np.uint32))
        with pytest.raises(PagelmError, match="row format"):
            load_token_embedding(model, "mapped", rows="f16")
        del dense, mapped, got
