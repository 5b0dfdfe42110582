"""The compiled RMS norm of a few rows against a float64 reference, on odd shapes, and its limits."""

import pytest
import torch

from pagelm.models.norms import MAX_ROWS, rms_norm_rows


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 33), (1, 5, 19), (MAX_ROWS, 1024)])
def test_rows_match_float64(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 3
    w = 1 + 0.2 * torch.randn(shape[-1], generator=gen)
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    got = rms_norm_rows(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert (got.double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()


def test_what_the_kernel_does_not_take_is_left_to_torch():
    w = torch.ones(16)
    assert rms_norm_rows(torch.ones(MAX_ROWS + 1, 16), w, 1e-6) is None  # a prefill's rows
    assert rms_norm_rows(torch.ones(2, 16, dtype=torch.bfloat16), w, 1e-6) is None
    assert rms_norm_rows(torch.ones(2, 32)[:, ::2], w, 1e-6) is None  # not contiguous
    assert rms_norm_rows(torch.ones(2, 8), w, 1e-6) is None  # another width


@pytest.mark.parametrize("n, heads, D", [(8, 9, 13), (3, 64, 7), (1, 5, 19)])
def test_tokens_alone_have_each_tokens_row_limit_and_bits(n, heads, D):
    gen = torch.Generator().manual_seed(n * heads + D)
    x = torch.randn(n, heads, D, generator=gen) * 3
    w = 1 + 0.2 * torch.randn(D, generator=gen)
    got = rms_norm_rows(x, w, 1e-6, tokens_alone=True)
    for i in range(n):
        assert torch.equal(got[i : i + 1].view(torch.int32), rms_norm_rows(x[i : i + 1], w, 1e-6).view(torch.int32))
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert (got.double() - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    if n * heads > MAX_ROWS:
        assert rms_norm_rows(x, w, 1e-6) is None  # not tokens alone: the rows of one prefill
    assert rms_norm_rows(torch.ones(2, MAX_ROWS + 1, D), w, 1e-6, tokens_alone=True) is None
