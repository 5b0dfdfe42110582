"""The GGML tensor type table: type ids and block layouts, as llama.cpp defines them.

Facts only, enough to size a tensor of any type; decoding lives in codecs.py.
"""

import enum

from pagelm.errors import ModelFormatError, UnsupportedError


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    # 4 and 5 (Q4_2, Q4_3) were removed from ggml.
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    # 31-33 (Q4_0_4_4, Q4_0_4_8, Q4_0_8_8) were removed from ggml.
    TQ1_0 = 34
    TQ2_0 = 35
    # 36-38 (IQ4_NL_4_4, IQ4_NL_4_8, IQ4_NL_8_8) were removed from ggml.
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_T = GGMLType
QK_K = 256

# (values per block, bytes per block)
BLOCK_LAYOUT: dict[GGMLType, tuple[int, int]] = {
    _T.F32: (1, 4),
    _T.F16: (1, 2),
    _T.Q4_0: (32, 2 + 16),
    _T.Q4_1: (32, 2 + 2 + 16),
    _T.Q5_0: (32, 2 + 4 + 16),
    _T.Q5_1: (32, 2 + 2 + 4 + 16),
    _T.Q8_0: (32, 2 + 32),
    _T.Q8_1: (32, 4 + 4 + 32),
    _T.Q2_K: (QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    _T.Q3_K: (QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    _T.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    _T.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 2 + QK_K // 8),
    _T.Q6_K: (QK_K, 2 + QK_K // 16 + 3 * QK_K // 4),
    _T.Q8_K: (QK_K, 4 + QK_K + QK_K // 8),
    _T.IQ2_XXS: (QK_K, 2 + QK_K // 4),
    _T.IQ2_XS: (QK_K, 2 + QK_K // 4 + QK_K // 32),
    _T.IQ3_XXS: (QK_K, 2 + QK_K // 4 + QK_K // 8),
    _T.IQ1_S: (QK_K, 2 + QK_K // 8 + QK_K // 16),
    _T.IQ4_NL: (32, 2 + 16),
    _T.IQ3_S: (QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    _T.IQ2_S: (QK_K, 2 + QK_K // 4 + QK_K // 16),
    _T.IQ4_XS: (QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    _T.I8: (1, 1),
    _T.I16: (1, 2),
    _T.I32: (1, 4),
    _T.I64: (1, 8),
    _T.F64: (1, 8),
    _T.IQ1_M: (QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    _T.BF16: (1, 2),
    _T.TQ1_0: (QK_K, 2 + 4 * 13),
    _T.TQ2_0: (QK_K, 2 + 64),
    _T.MXFP4: (32, 1 + 16),
    _T.NVFP4: (64, 4 + 32),
    _T.Q1_0: (128, 2 + 16),
}


# Byte offsets of the fp16 scale fields (d, and m / dmin where present) inside one block of the
# decodable block types; every other byte of a block is a code.
SCALE_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def as_ggml_type(type_id: int) -> GGMLType:
    """The GGMLType of a type id read from a file; UnsupportedError for ids ggml lacks."""
    if type(type_id) is GGMLType:
        return type_id
    try:
        return GGMLType(type_id)
    except ValueError:
        raise UnsupportedError(f"unknown GGML type id {type_id!r}") from None


def row_nbytes(ggml_type: int, n_values: int) -> int:
    """Bytes taken by `n_values` consecutive values of a GGML type."""
    t = as_ggml_type(ggml_type)
    block_values, block_bytes = BLOCK_LAYOUT[t]
    if n_values < 0 or n_values % block_values:
        raise ModelFormatError(
            f"{t.name}: {n_values} values is not a whole number of blocks "
            f"(block size {block_values})"
        )
    return n_values // block_values * block_bytes
