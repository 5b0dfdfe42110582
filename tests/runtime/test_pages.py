"""Zeroed buffers resident only where written (runtime.pages), and KV caches built on them: a
session reserved for a long context holds the pages of the positions it has seen."""

import mmap

import numpy as np
import torch

import pagelm
from pagelm.runtime.pages import ZeroedTensors, resident_bytes, zeroed

PAGE = mmap.PAGESIZE


def test_a_zeroed_buffer_is_zero_and_resident_only_where_written():
    buffer = zeroed(64 * PAGE)
    assert resident_bytes(buffer) == 0
    buffer[5 * PAGE + 7] = 1
    buffer[40 * PAGE : 42 * PAGE] = 2
    assert resident_bytes(buffer) == 3 * PAGE
    assert int(buffer.sum()) == 1 + 2 * 2 * PAGE  # (mincore counts pages only read as resident too: the zero page)
    assert resident_bytes(torch.ones(3 * PAGE, dtype=torch.uint8)) >= 3 * PAGE  # an ordinary tensor: all written


def test_zeroed_tensors_are_separate_zero_tensors_of_the_shape():
    caches = ZeroedTensors((3, 1000, 5), 4, torch.bfloat16, torch.device("cpu"))
    assert [tuple(t.shape) for t in caches.tensors] == [(3, 1000, 5)] * 4
    caches.tensors[1][2, 999] = 1.5
    assert caches.nbytes == PAGE
    assert all(t.dtype == torch.bfloat16 for t in caches.tensors)
    assert [float(t.sum()) for t in caches.tensors] == [0.0, 7.5, 0.0, 0.0]


def test_a_long_context_session_holds_the_pages_of_its_positions(smollm2_gguf):
    model = pagelm.load(smollm2_gguf, threads=1)
    session = model.session(max_len=4096)
    reserved = session.state._caches.tensors
    full = sum(t.numel() * t.element_size() for t in reserved)
    assert session.state.nbytes == 0
    session.prefill(list(range(1, 101)))
    used = session.state.nbytes
    layers, (heads, _, head_dim) = len(reserved), reserved[0].shape
    written = layers * heads * 100 * head_dim * reserved[0].element_size()
    assert written <= used <= written + layers * heads * PAGE  # each head's rows end within a page
    assert used < full / 20
    fresh = model.session(max_len=4096)  # the logits do not depend on what was never written
    assert np.array_equal(fresh.prefill(list(range(1, 101))), session.logits)
