"""What a model gets from a file: mapped tensors and the token embedding and output head served
from them (here, numpy only); linear operators, dense or mapped (`weights.linear`), and the loader
that hands config values, small tensors and operators to an architecture (`weights.loader`)."""

from pagelm.weights.embedding import (
    EMBEDDING_MODES,
    OUTPUT_HEAD,
    TOKEN_EMBEDDING,
    DenseTable,
    EmbeddingMode,
    MappedRows,
    OutputHead,
    TokenEmbedding,
    load_output_head,
    load_token_embedding,
)
from pagelm.weights.mapped import MappedTensor, TiledTensor, page_spans, table_tensor

__all__ = [
    "EMBEDDING_MODES", "OUTPUT_HEAD", "TOKEN_EMBEDDING", "DenseTable", "EmbeddingMode", "MappedRows",
    "MappedTensor", "OutputHead", "TiledTensor", "TokenEmbedding", "load_output_head", "load_token_embedding",
    "page_spans", "table_tensor",
]
