"""GGML tensor types and the codecs between their block bytes and float32 / bf16 arrays."""

from pagelm.quant.codecs import (
    DECODABLE,
    ENCODABLE,
    K_QUANTS,
    bf16_to_f32,
    decode_bf16,
    decode_f32,
    encode,
    f32_to_bf16,
)
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType, as_ggml_type, row_nbytes

__all__ = [
    "BLOCK_LAYOUT",
    "DECODABLE",
    "ENCODABLE",
    "GGMLType",
    "K_QUANTS",
    "as_ggml_type",
    "bf16_to_f32",
    "decode_bf16",
    "decode_f32",
    "encode",
    "f32_to_bf16",
    "row_nbytes",
]
