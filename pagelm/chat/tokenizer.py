"""Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, on HF `tokenizers`.

Two vocabulary kinds are understood:
- `gpt2`: byte-level BPE with the file's merges; the split regex is chosen by `tokenizer.ggml.pre`.
- `llama` (SentencePiece-style, as gemma3 uses): BPE with byte fallback over `▁`-spelled text;
  the file has no merges, so they are rebuilt from the vocabulary with the token order as the
  merge priority (Gemma's scores do not follow its merge order; its file order does).

Control tokens (type 3) become special tokens (matched whole in text, dropped by
`decode(skip_special=True)`); user-defined ones (type 4) are matched whole but kept on decode.

`gpt2` vocabularies are tokenized by `_ByteBPE`, a compact re-implementation of the BPE model
step of HF `tokenizers` (same normalizer and pre-tokenizer objects, same merge algorithm, same
added-token matching), whose tables are flat arrays: the Qwen3.5 vocabulary (248k tokens, 500k
merges) costs ~15 MiB of anonymous memory there, against 100-300 MiB inside `tokenizers` (its
hash maps, plus the heap parsing a tokenizer.json leaves behind). Vocabularies it cannot take
(no byte token for some byte, duplicate tokens, a merge naming an unknown token, ...) and
`llama` ones are built on HF `tokenizers`.

Building takes seconds (the merges are parsed once), so the result is cached on disk under a hash
of the file's tokenizer metadata bytes (see `_cache_key`): `<key>.bpe` (the merge table of
`_ByteBPE`) or `<key>.json` (the serialized HF `tokenizer.json`).
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re
import struct
import tempfile
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from functools import lru_cache

from pagelm.chat import harmony
from pagelm.runtime import heap
from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.gguf import STRING_LENGTH, GGUFArray, GGUFFile, GGUFValueType

# Bump when the way a tokenizer is built changes: old cache entries then stop matching.
_BUILDER_VERSION = 2
_PREFIX = "tokenizer.ggml."

CONTROL, USER_DEFINED = 3, 4

# Split regexes (the pre-tokenizer), as llama.cpp / the reference tokenizers define them.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-4o's, and gpt-oss's o200k_harmony): cased words keep their leading capitals
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# pre name -> (split regex, split digits one by one first, NFC-normalize, ignore_merges)
_GPT2_PRE: dict[str, tuple[str, bool, bool, bool]] = {
    "default": (_GPT2_SPLIT, False, False, False),
    "gpt2": (_GPT2_SPLIT, False, False, False),
    "smollm": (_GPT2_SPLIT, True, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False, True),
    "llama3": (_LLAMA3_SPLIT, False, False, True),
    "lfm2": (_LLAMA3_SPLIT, False, False, True),  # llama.cpp's name for LFM2's pre-tokenizer, Llama 3's split
    "qwen2": (_QWEN2_SPLIT, False, True, False),
    "qwen35": (_QWEN35_SPLIT, False, True, True),  # tiktoken semantics: a whole piece in the vocab wins
    "gpt-4o": (_O200K_SPLIT, False, False, True),  # gpt-oss; tiktoken semantics as qwen35
}

# Control tokens that end a turn, added to eos_ids when the vocabulary has them. In a harmony
# vocabulary (gpt-oss's) `<|end|>` ends a message, not the answer: there `<|return|>` and `<|call|>` do.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")
_HARMONY_END_OF_TURN = ("<|endoftext|>", *harmony.STOP_TOKENS)


def default_cache_dir() -> str:
    home = os.environ.get("PAGELM_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pagelm")
    return os.path.join(home, "tokenizers")


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[dict[int, str], frozenset[str]]:
    """GPT-2's byte -> printable character map, and its set of characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars, frozenset(chars.values())


class Tokenizer:
    """A model's tokenizer: text <-> token ids, plus its BOS/EOS conventions."""

    def __init__(self, backend, *, bos_id: int | None, eos_ids: tuple[int, ...], add_bos: bool, add_eos: bool,
                 vocab_size: int, name: str = "<tokenizer>", cache_path: str | None = None,
                 from_cache: bool = False):
        # backend: a `_ByteBPE`, or a tokenizers.Tokenizer (then also `self.hf`)
        self.hf = None if isinstance(backend, _ByteBPE) else backend
        self._backend = backend if self.hf is None else _HFBackend(backend)
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos, self.add_eos = add_bos, add_eos
        self.vocab_size = vocab_size
        self.name = name
        self.cache_path = cache_path  # the cache entry (.bpe or tokenizer.json) this came from or was saved to
        self.from_cache = from_cache
        self.eos_id = eos_ids[0] if eos_ids else None
        self._special_ids = self._backend.special_ids

    # ------------------------------------------------------------------------------ building

    @classmethod
    def from_gguf(cls, model: GGUFFile, cache_dir: str | None = None, *, compact: bool = True) -> Tokenizer:
        """The tokenizer of `model`, from the cache under `cache_dir` when it has it.

        compact=False builds a `gpt2` vocabulary on HF `tokenizers` even where `_ByteBPE` takes it
        (for comparisons; it costs 100-300 MiB for a large vocabulary).
        """
        from tokenizers import Tokenizer as HFTokenizer

        md = model.metadata
        kind = _require(model, "model")
        if kind == "none":
            raise UnsupportedError(f"{model.name}: metadata key 'tokenizer.ggml.model' is 'none': the file carries "
                                   f"no vocabulary, only token ids (nothing to tokenize text with)")
        if kind not in ("gpt2", "llama"):
            raise UnsupportedError(f"{model.name}: metadata key 'tokenizer.ggml.model' is '{kind}', "
                                   f"expected 'gpt2' or 'llama'")
        pre = md.get(_PREFIX + "pre", "default")
        if kind == "gpt2" and pre not in _GPT2_PRE:
            raise UnsupportedError(f"{model.name}: metadata key 'tokenizer.ggml.pre' is '{pre}', expected one of "
                                   f"{', '.join(sorted(_GPT2_PRE))}")
        tokens = _require(model, "tokens")
        if not isinstance(tokens, GGUFArray) or tokens.element_type != GGUFValueType.STRING or not len(tokens):
            raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.tokens' must be a non-empty string array")
        n = len(tokens)
        token_types = md.get(_PREFIX + "token_type")
        if token_types is not None and len(token_types) != n:
            raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.token_type' has {len(token_types)} "
                                   f"entries, expected {n} (one per token)")
        types = token_types.to_numpy() if token_types is not None else None

        cache_dir = default_cache_dir() if cache_dir is None else cache_dir
        key = _cache_key(model)
        json_path = os.path.join(cache_dir, key + ".json")
        bpe_path = os.path.join(cache_dir, key + ".bpe")
        backend, path, from_cache = None, json_path, False
        if kind == "gpt2" and compact:
            if os.path.exists(bpe_path):
                backend = _ByteBPE.build(model, tokens, types, pre, cached=bpe_path)
                path, from_cache = bpe_path, backend is not None
            if backend is None and not os.path.exists(json_path):
                backend = _ByteBPE.build(model, tokens, types, pre, save=bpe_path)
                path = bpe_path
        if backend is None:
            path = json_path
            if os.path.exists(json_path):
                try:
                    backend = HFTokenizer.from_file(json_path)
                    from_cache = True
                except Exception:  # a damaged entry: rebuild it
                    backend = None
            if backend is None:
                if kind == "gpt2":
                    backend = _build_gpt2(model, tokens.tolist(), types, pre)
                else:
                    backend = _build_spm(model, tokens.tolist(), types)
                _save_atomic(backend.to_str(), json_path)
        heap.trim()  # hand back the heap the build (or the JSON parse) left free

        tok = cls(backend, bos_id=None, eos_ids=(), add_bos=False, add_eos=False, vocab_size=n)
        bos = md.get(_PREFIX + "bos_token_id")
        eos = md.get(_PREFIX + "eos_token_id")
        eot = md.get(_PREFIX + "eot_token_id")
        for name, value in (("bos_token_id", bos), ("eos_token_id", eos), ("eot_token_id", eot)):
            if value is not None and not (isinstance(value, int) and 0 <= value < n):
                raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.{name}' is {value!r}, "
                                       f"expected a token id below {n}")
        eos_ids = tok._with_end_of_turn([i for i in (eos, eot) if i is not None])
        add_bos = bool(md.get(_PREFIX + "add_bos_token", kind == "llama"))
        add_eos = bool(md.get(_PREFIX + "add_eos_token", False))
        if add_bos and bos is None:
            raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.add_bos_token' is set but "
                                   f"'tokenizer.ggml.bos_token_id' is missing")
        if add_eos and eos is None:
            raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.add_eos_token' is set but "
                                   f"'tokenizer.ggml.eos_token_id' is missing")
        return cls(backend, bos_id=bos, eos_ids=tuple(eos_ids), add_bos=add_bos, add_eos=add_eos,
                   vocab_size=n, name=model.name, cache_path=path, from_cache=from_cache)

    def _with_end_of_turn(self, eos_ids: list[int]) -> list[int]:
        """`eos_ids` and the vocabulary's special end-of-turn tokens (_END_OF_TURN), once each."""
        channel = self.token_to_id(harmony.CHANNEL)
        ends = (self.token_to_id(text) for text in
                (_HARMONY_END_OF_TURN if channel in self._special_ids else _END_OF_TURN))
        return list(dict.fromkeys([*eos_ids, *(i for i in ends if i is not None and i in self._special_ids)]))

    @classmethod
    def from_hf_directory(cls, checkpoint) -> Tokenizer:
        """The tokenizer of a Hugging Face checkpoint directory (`weights.hf.HFCheckpoint`): its
        tokenizer.json on HF `tokenizers`, with BOS/EOS as the checkpoint's metadata gives them."""
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(checkpoint.path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelFormatError(f"{checkpoint.path}: no tokenizer.json in the directory (pagelm reads the "
                                   f"tokenizer from it)")
        try:
            backend = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises plain Exceptions for every kind of bad file
            raise ModelFormatError(f"{path}: not a tokenizer file pagelm can read ({str(e)[:200]})") from None
        heap.trim()
        n = backend.get_vocab_size(with_added_tokens=True)
        md = checkpoint.metadata
        bos = md.get(_PREFIX + "bos_token_id")
        eos = md.get("tokenizer.hf.eos_token_ids") or [md.get(_PREFIX + "eos_token_id")]
        tok = cls(backend, bos_id=None, eos_ids=(), add_bos=False, add_eos=False, vocab_size=n)
        eos_ids = tok._with_end_of_turn([i for i in eos if isinstance(i, int) and 0 <= i < n])
        add_bos = bool(md.get(_PREFIX + "add_bos_token", False)) and bos is not None
        return cls(backend, bos_id=bos if isinstance(bos, int) and 0 <= bos < n else None,
                   eos_ids=tuple(eos_ids), add_bos=add_bos, add_eos=False, vocab_size=n,
                   name=path, cache_path=path)

    @classmethod
    def open(cls, checkpoint) -> Tokenizer:
        """The tokenizer of a checkpoint: a GGUF file's metadata, or a directory's tokenizer.json."""
        from pagelm.weights.hf import HFCheckpoint

        if isinstance(checkpoint, HFCheckpoint):
            return cls.from_hf_directory(checkpoint)
        return cls.from_gguf(checkpoint)

    # ------------------------------------------------------------------------------ use

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised as such.

        add_special adds BOS / EOS where the file's add_bos_token / add_eos_token ask for them.
        """
        return self._wrap(self._backend.encode(text), add_special)

    def encode_input(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of `text` as one whole input, framed as the model's tokenizer frames one: by a
        Hugging Face tokenizer.json's post-processor when it has one (as sentence-transformers
        encodes, e.g. EmbeddingGemma's <bos> … <eos>), else with the BOS / EOS the file asks for.
        With `limit`, an input longer than that loses the end of its text, its frame kept."""
        ids = self._framed(text)
        if limit is None or len(ids) <= limit:
            return ids
        extra = len(ids) - len(self.encode(text))
        empty = self._framed("")
        head = 0  # the frame's tokens before the text: those it shares with an empty input's frame
        while head < min(extra, len(empty)) and ids[head] == empty[head]:
            head += 1
        keep = limit - extra
        if keep < 1:
            return ids[:limit]
        return ids[: head + keep] + ids[len(ids) - (extra - head):]

    def _framed(self, text: str) -> list[int]:
        if self.hf is not None and self.hf.post_processor is not None:
            return self.hf.encode(text, add_special_tokens=True).ids
        return self.encode(text, add_special=True)

    def encode_batch(self, texts: Sequence[str], add_special: bool = False) -> list[list[int]]:
        """encode() of each text (in parallel inside `tokenizers` when built on it)."""
        return [self._wrap(ids, add_special) for ids in self._backend.encode_batch(list(texts))]

    def _wrap(self, ids: list[int], add_special: bool) -> list[int]:
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab {self.vocab_size}, bos {self.bos_id}, eos {self.eos_ids})"


class _HFBackend:
    """The `_ByteBPE` interface over a tokenizers.Tokenizer."""

    def __init__(self, hf):
        self.hf = hf
        self.special_ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)


# Tokens spelled in GPT-2's byte alphabet, as UTF-8: `!`..`~`, U+00A1..U+00AC, U+00AE..U+0143.
_ALPHABET_UTF8 = re.compile(rb"(?:[\x21-\x7e]|\xc2[\xa1-\xac\xae-\xbf]|[\xc3\xc4][\x80-\xbf]|\xc5[\x80-\x83])*")
_BPE_MAGIC = b"pagelm-bpe\x00\x01"
_BPE_HEADER = struct.Struct("<12sQQ")  # magic, tokens, merges


class _ByteBPE:
    """Byte-level BPE with HF `tokenizers`' results and a small memory footprint.

    Only the BPE model step is re-implemented; the rest is HF's own objects or a copy of its rule:
    added tokens are matched whole in the raw text, leftmost-longest (what `AddedVocabulary`
    does); each stretch between them goes through HF's normalizer and pre-tokenizer objects (the
    same ones `_build_gpt2` installs), and each piece through `_bpe`, a line-by-line port of
    `tokenizers`' `BPE::tokenize` / `Word::merge_all` (whole-piece lookup when ignore_merges;
    then merges lowest rank first, ties leftmost, queue entries dropped when their pair no longer
    yields the same token). Decoding follows `decoders.ByteLevel`: each token's bytes (a token
    spelled outside the byte alphabet stands for its own UTF-8), invalid UTF-8 as U+FFFD.

    The tables are flat: the `tokenizer.ggml.tokens` bytes as stored (a copy, so the tokenizer
    outlives the file), an offsets array, an open-addressing table of token ids keyed by
    Python's hash of the spelled token, and the merges as three sorted arrays searched with
    `bisect` (key `left * n + right`, merge rank, merged token). For Qwen3.5 that is ~4 + 1 + 2 +
    8 MiB, where `tokenizers` holds 100-300 MiB.
    """

    def __init__(self):
        self.special_ids: frozenset[int] = frozenset()
        self._cache: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------------------ building

    @classmethod
    def build(cls, model: GGUFFile, tokens: GGUFArray, types, pre: str, *, cached: str | None = None,
              save: str | None = None) -> _ByteBPE | None:
        """The tokenizer, or None where HF `tokenizers` has to build it (it then also reports what
        is wrong with the file). The merge table comes from `cached` if given, else is built from
        the file's merges and written to `save`."""
        from tokenizers import Regex, normalizers, pre_tokenizers

        merges = _require(model, "merges")
        if not isinstance(merges, GGUFArray) or merges.element_type != GGUFValueType.STRING:
            return None
        self = cls()
        n = self._n = len(tokens)
        packed = tokens.packed_strings()
        if len(packed) >= 1 << 32 or n >= 1 << 31:
            return None
        region = self._region = bytes(packed)
        starts, pos, unpack = array("I"), 0, STRING_LENGTH.unpack_from
        for _ in range(n):
            starts.append(pos)
            pos += 8 + unpack(region, pos)[0]
        starts.append(pos)
        self._starts = starts
        spelling, _ = byte_alphabet()

        # Token ids by spelled token (HF's vocab: a token stored outside the byte alphabet is
        # spelled as its UTF-8 bytes). A spelling that occurs twice: left to HF.
        respelled: dict[int, bytes] = {}
        self._respelled = respelled
        in_alphabet = _ALPHABET_UTF8.fullmatch
        size = 1 << (2 * n).bit_length()
        table = self._table = array("i", [-1]) * size
        self._mask = mask = size - 1
        for i in range(n):
            s, e = starts[i] + 8, starts[i + 1]
            key = region[s:e]
            if not in_alphabet(region, s, e):
                try:
                    key.decode("utf-8")
                except UnicodeDecodeError:
                    return None
                key = respelled[i] = "".join(spelling[b] for b in key).encode()
            h = hash(key) & mask
            while (j := table[h]) >= 0:
                if self._key(j) == key:
                    return None
                h = (h + 1) & mask
            table[h] = i
        char_ids = {}
        for b, char in spelling.items():
            i = self._lookup(char.encode())
            if i is None:  # HF would drop that byte from the text
                return None
            char_ids[char] = i
        self._char_ids = char_ids

        # Added tokens, as `_add_special` adds them to HF.
        added: dict[str, int] = {}
        special = set()
        if types is not None:
            for kind in (CONTROL, USER_DEFINED):
                for i in (types == kind).nonzero()[0].tolist():
                    text = self._raw(i).decode("utf-8")
                    if not text or (kind == CONTROL and i in respelled):
                        continue
                    if text in added:  # HF would keep the first id for both
                        return None
                    added[text] = i
                    if kind == CONTROL:
                        special.add(i)
        self._added = added
        self._added_by_id = {i: t for t, i in added.items()}
        self.special_ids = frozenset(special)
        self._added_re = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))) \
            if added else None

        split, digits, nfc, ignore_merges = _GPT2_PRE[pre]
        self._ignore_merges = ignore_merges
        self._normalizer = normalizers.NFC() if nfc else None
        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        self._pre = pre_tokenizers.Sequence(steps)
        decode_table = {ord(c): b for b, c in spelling.items()}
        self._unspell = lambda text: text.translate(decode_table).encode("latin-1")

        if cached is not None:
            if not self._load_merges(cached, len(merges)):
                return None
        else:
            if not self._build_merges(model, merges):
                return None
            if save is not None:
                _save_atomic(_BPE_HEADER.pack(_BPE_MAGIC, n, len(self._mkeys)) + self._mkeys.tobytes()
                             + self._mranks.tobytes() + self._mnew.tobytes(), save)
        return self

    def _build_merges(self, model: GGUFFile, merges: GGUFArray) -> bool:
        """HF's merge map ((left, right) -> (rank, merged id); a repeated pair keeps its last rank)."""
        import numpy as np

        n, lookup, unpack = self._n, self._lookup, STRING_LENGTH.unpack_from
        buf, pos = merges.packed_strings(), 0
        m = len(merges)
        keys, new = array("q"), array("i")
        for k in range(m):
            length = unpack(buf, pos)[0]
            item = bytes(buf[pos + 8:pos + 8 + length])
            pos += 8 + length
            cut = item.find(b" ")
            if cut < 0:
                raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.merges' element {k} is "
                                       f"{item.decode('utf-8', 'replace')!r}, expected two tokens separated by a space")
            left, right = lookup(item[:cut]), lookup(item[cut + 1:])
            merged = lookup(item[:cut] + item[cut + 1:])
            if left is None or right is None or merged is None:
                return False  # HF reports it
            keys.append(left * n + right)
            new.append(merged)
        flat = np.frombuffer(keys, np.int64)
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        last = np.append(ordered[1:] != ordered[:-1], True) if m else np.zeros(0, bool)
        self._mkeys = array("q", ordered[last].tobytes())
        self._mranks = array("i", order[last].astype(np.int32).tobytes())
        self._mnew = array("i", np.frombuffer(new, np.int32)[order[last]].tobytes())
        return True

    def _load_merges(self, path: str, m: int) -> bool:
        try:
            with open(path, "rb") as fh:
                magic, n, count = _BPE_HEADER.unpack(fh.read(_BPE_HEADER.size))
                if magic != _BPE_MAGIC or n != self._n or count > m:
                    return False
                self._mkeys, self._mranks, self._mnew = array("q"), array("i"), array("i")
                self._mkeys.fromfile(fh, count)
                self._mranks.fromfile(fh, count)
                self._mnew.fromfile(fh, count)
                if fh.read(1):
                    return False
        except (OSError, EOFError, struct.error):
            return False
        return True

    # ------------------------------------------------------------------------------ tables

    def _raw(self, i: int) -> bytes:
        """Token i as stored in the file (UTF-8)."""
        return self._region[self._starts[i] + 8:self._starts[i + 1]]

    def _key(self, i: int) -> bytes:
        """Token i as HF's vocabulary spells it (UTF-8)."""
        return self._respelled.get(i) or self._region[self._starts[i] + 8:self._starts[i + 1]]

    def _lookup(self, key: bytes) -> int | None:
        table, mask, region, starts, respelled = self._table, self._mask, self._region, self._starts, self._respelled
        h = hash(key) & mask
        while (i := table[h]) >= 0:
            if (region[starts[i] + 8:starts[i + 1]] if i not in respelled else respelled[i]) == key:
                return i
            h = (h + 1) & mask
        return None

    # ------------------------------------------------------------------------------ use

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pos = 0
        if self._added_re is not None:
            added = self._added
            for match in self._added_re.finditer(text):
                if match.start() > pos:
                    self._encode_plain(text[pos:match.start()], out)
                out.append(added[match.group()])
                pos = match.end()
        if pos < len(text):
            self._encode_plain(text[pos:] if pos else text, out)
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def _encode_plain(self, text: str, out: list[int]) -> None:
        if self._normalizer is not None and not text.isascii():
            text = self._normalizer.normalize_str(text)
        lookup, cache, ignore_merges = self._lookup, self._cache, self._ignore_merges
        for piece, _ in self._pre.pre_tokenize_str(text):
            if ignore_merges:
                i = lookup(piece.encode())
                if i is not None:
                    out.append(i)
                    continue
            ids = cache.get(piece)
            if ids is None:
                ids = self._bpe(piece)
                if len(cache) >= 4096:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)

    def _bpe(self, piece: str) -> tuple[int, ...]:
        """`tokenizers`' Word::merge_all over the piece's byte tokens."""
        c = [self._char_ids[ch] for ch in piece]
        size = len(c)
        if size < 2:
            return tuple(c)
        n, keys, ranks, new = self._n, self._mkeys, self._mranks, self._mnew
        count = len(keys)

        def merge(a: int, b: int):
            k = a * n + b
            j = bisect_left(keys, k)
            return (ranks[j], new[j]) if j < count and keys[j] == k else None

        nxt = list(range(1, size + 1))
        nxt[-1] = -1
        prv = list(range(-1, size - 1))
        alive = [True] * size
        queue = []
        for pos in range(size - 1):
            m = merge(c[pos], c[pos + 1])
            if m is not None:
                queue.append((m[0], pos, m[1]))
        heapq.heapify(queue)
        pop, push = heapq.heappop, heapq.heappush
        while queue:
            _, pos, target = pop(queue)
            if not alive[pos]:
                continue
            right = nxt[pos]
            if right == -1:
                continue
            m = merge(c[pos], c[right])
            if m is None or m[1] != target:  # an expired entry
                continue
            c[pos] = target
            alive[right] = False
            after = nxt[right]
            nxt[pos] = after
            if after != -1:
                prv[after] = pos
            before = prv[pos]
            if before >= 0:
                m = merge(c[before], target)
                if m is not None:
                    push(queue, (m[0], before, m[1]))
            if after != -1:
                m = merge(target, c[after])
                if m is not None:
                    push(queue, (m[0], pos, m[1]))
        return tuple(c[i] for i in range(size) if alive[i])

    def decode(self, ids: list[int], skip_special: bool) -> str:
        n, region, starts, respelled = self._n, self._region, self._starts, self._respelled
        skip = self.special_ids if skip_special else ()
        chunks: list[bytes] = []
        run: list[bytes] = []  # UTF-8 of byte-alphabet spellings, unspelled together
        for i in ids:
            if i < 0:
                raise OverflowError("can't convert negative int to unsigned")
            if i >= n or i in skip:
                continue  # HF skips ids it does not know
            raw = region[starts[i] + 8:starts[i + 1]]
            if i in respelled:
                if run:
                    chunks.append(self._unspell(b"".join(run).decode()))
                    run = []
                chunks.append(raw)
            else:
                run.append(raw)
        if run:
            chunks.append(self._unspell(b"".join(run).decode()))
        return b"".join(chunks).decode("utf-8", "replace")

    def token_to_id(self, token: str) -> int | None:
        i = self._added.get(token)
        return i if i is not None else self._lookup(token.encode())

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < self._n:
            return None
        text = self._added_by_id.get(token_id)
        return text if text is not None else self._key(token_id).decode()


class StreamDecoder:
    """Incremental detokenizer: push ids one at a time, get the new text they complete.

    Text is emitted only once it is final: a trailing incomplete UTF-8 sequence (U+FFFD at the
    end of the decoded tail) is held back until the bytes that complete it arrive. Decoding a
    short window of ids before the new ones keeps context-dependent decoders (SentencePiece's
    leading-space handling) right. `flush()` returns whatever is held back at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] is the context window already emitted
        self._read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        dec = self.tokenizer.decode
        before = dec(self._ids[self._prefix:self._read], self.skip_special)
        now = dec(self._ids[self._prefix:], self.skip_special)
        if now.endswith("\ufffd") or len(now) <= len(before) or not now.startswith(before):
            # Incomplete UTF-8 at the end (or nothing new yet): wait for more ids. Each id adds
            # at least one byte, so after _MAX_PENDING ids the bytes are invalid, not incomplete:
            # emit them (as U+FFFD) rather than stall the stream.
            if len(self._ids) - self._read < _MAX_PENDING or len(now) <= len(before):
                return ""
        out = now[len(before):] if now.startswith(before) else now
        self._prefix, self._read = self._read, len(self._ids)
        return out

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end of the stream)."""
        if self._read == len(self._ids):
            return ""
        dec = self.tokenizer.decode
        before = dec(self._ids[self._prefix:self._read], self.skip_special)
        now = dec(self._ids[self._prefix:], self.skip_special)
        self._prefix = self._read = len(self._ids)
        return now[len(before):] if now.startswith(before) else now


_MAX_PENDING = 8


# ---------------------------------------------------------------------------------- helpers


def _require(model: GGUFFile, short: str):
    key = _PREFIX + short
    if key not in model.metadata:
        raise ModelFormatError(f"{model.name}: metadata key '{key}' missing, needed to build the tokenizer")
    return model.metadata[key]


def _cache_key(model: GGUFFile) -> str:
    """sha256 over the raw bytes of every `tokenizer.ggml.*` value (plus the builder version).

    Why this key: it is exact (two files share an entry only if their tokenizer metadata is
    byte-identical, so a renamed or copied file, or another synthetic seed, reuses the entry, and
    an edited vocabulary never hits a stale one) and still cheap: numeric arrays are hashed
    straight from the map, and string arrays as the byte range their length prefixes span
    (one walk over the prefixes, ~0.1 s for 750k strings, no Python string per element).
    Hashing the whole file would read hundreds of MB; (path, size, mtime) would miss copies and
    could be fooled by an in-place rewrite that keeps the mtime.
    """
    h = hashlib.sha256(f"pagelm-tokenizer/{_BUILDER_VERSION}".encode())
    md = model.metadata
    for key in sorted(k for k in md if k.startswith(_PREFIX)):
        value = md[key]
        h.update(key.encode() + b"\0")
        if isinstance(value, GGUFArray):
            h.update(struct.pack("<BQ", value.element_type, len(value)))
            if value.element_type == GGUFValueType.STRING:
                h.update(value.packed_strings())
            else:
                h.update(value.to_numpy().tobytes())
        else:
            h.update(repr((type(value).__name__, value)).encode())
        h.update(b"\1")
    return h.hexdigest()[:32]


def _save_atomic(text: str | bytes, path: str) -> None:
    """Write `text` to `path` via a unique `.part` file and os.replace (readers never see half a file)."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".part")
    except OSError:
        return  # an unwritable cache only costs the next build its time
    try:
        with (os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")) as fh:
            fh.write(text)
        os.replace(part, path)
    except BaseException as exc:
        try:
            os.unlink(part)
        except OSError:
            pass
        if not isinstance(exc, OSError):  # a full disk only costs the next build its time
            raise


def _build_gpt2(model: GGUFFile, tokens: list[str], types, pre: str):
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    merges_arr = _require(model, "merges")
    if not isinstance(merges_arr, GGUFArray) or merges_arr.element_type != GGUFValueType.STRING:
        raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.merges' must be a string array")
    merges = []
    for i, m in enumerate(merges_arr):
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.merges' element {i} is {m!r}, "
                                   f"expected two tokens separated by a space")
        merges.append((left, right))
    spelling, alphabet = byte_alphabet()
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not alphabet.issuperset(t):  # stored as text, not in the byte alphabet (e.g. a control token)
            t = "".join(spelling[b] for b in t.encode("utf-8"))
        vocab[t] = i
    split, digits, nfc, ignore_merges = _GPT2_PRE[pre]
    try:
        hf = HFTokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=ignore_merges))
    except Exception as e:  # a merge naming a token the vocabulary lacks
        raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.merges' does not fit "
                               f"'tokenizer.ggml.tokens': {e}") from None
    if nfc:
        hf.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet is a converter mislabel (llama.cpp): not added.
    _add_special(hf, tokens, types, lambda t: t if alphabet.issuperset(t) else None)
    return hf


def _build_spm(model: GGUFFile, tokens: list[str], types):
    """SentencePiece-style BPE (gemma): `▁` for spaces, byte fallback through `<0x..>` tokens."""
    from tokenizers import decoders, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    if types is None:
        raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.token_type' missing, needed to build "
                               f"a SentencePiece tokenizer")
    # llama.cpp's converter writes user-defined tokens with `▁` turned back into spaces;
    # the model sees `▁`, so spell them that way again.
    user = set(int(i) for i in (types == USER_DEFINED).nonzero()[0])
    spelled = [t.replace(" ", "\u2581") if i in user and " " in t else t for i, t in enumerate(tokens)]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = _merges_from_vocab(spelled, vocab)
    unk_id = model.metadata.get(_PREFIX + "unknown_token_id")
    unk = spelled[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(spelled) else None
    hf = HFTokenizer(BPE(vocab, merges, fuse_unk=True, byte_fallback=True, unk_token=unk))
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Respelled tokens are left to the merges: as added tokens they would match only a literal `▁`.
    _add_special(hf, tokens, types, lambda t: t if " " not in t else None)
    return hf


def _merges_from_vocab(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best first: by the token's position in the file,
    then longest left part first (what SentencePiece's BPE order comes down to for gemma)."""
    merges: list[tuple[int, int, str, str]] = []
    get = vocab.get
    for token, index in vocab.items():
        if len(token) < 2:
            continue
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if get(left) is not None and get(right) is not None:
                merges.append((index, -cut, left, right))
    merges.sort()
    return [(left, right) for _, _, left, right in merges]


def _add_special(hf, tokens: list[str], types, spell) -> None:
    """Control tokens as special added tokens, user-defined ones as plain added tokens.

    `spell(token)` gives the text to match, or None to leave the token to the model alone.
    """
    from tokenizers import AddedToken

    if types is None:
        return
    for kind, special in ((CONTROL, True), (USER_DEFINED, False)):
        added = []
        for i in (types == kind).nonzero()[0].tolist():
            text = spell(tokens[i])
            if text:
                added.append(AddedToken(text, special=special, normalized=False))
        if added and special:
            hf.add_special_tokens(added)
        elif added:
            hf.add_tokens(added)


__all__ = ["StreamDecoder", "Tokenizer", "default_cache_dir"]
