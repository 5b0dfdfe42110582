import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.quant import BLOCK_LAYOUT, GGMLType, as_ggml_type, row_nbytes


def test_type_ids_match_gguf():
    assert {t.name: t.value for t in GGMLType} == {
        t.name: t.value for t in GGMLQuantizationType
    }


def test_block_layout_matches_gguf_for_every_type():
    assert set(BLOCK_LAYOUT) == set(GGMLType)
    for t in GGMLType:
        assert BLOCK_LAYOUT[t] == GGML_QUANT_SIZES[GGMLQuantizationType(t)], t.name


@pytest.mark.parametrize(
    "ggml_type, n_values, expected",
    [
        (GGMLType.F32, 7, 28),
        (GGMLType.BF16, 3, 6),
        (GGMLType.Q8_0, 1024, 1088),
        (GGMLType.Q4_K, 512, 288),
        (GGMLType.Q6_K, 256, 210),
        (GGMLType.IQ2_XXS, 256, 66),  # sized even though it cannot be decoded
        (GGMLType.Q8_0, 0, 0),
        (14, 256, 210),  # a plain id read from a file
    ],
)
def test_row_nbytes(ggml_type, n_values, expected):
    assert row_nbytes(ggml_type, n_values) == expected


def test_row_nbytes_rejects_partial_block():
    with pytest.raises(ModelFormatError) as e:
        row_nbytes(GGMLType.Q4_K, 1000)
    assert "Q4_K" in str(e.value) and "1000" in str(e.value) and "256" in str(e.value)


def test_unknown_type_id_is_unsupported():
    assert as_ggml_type(30) is GGMLType.BF16
    for bad in (4, 31, 99):
        with pytest.raises(UnsupportedError, match=str(bad)):
            row_nbytes(bad, 32)
