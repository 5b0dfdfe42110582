"""Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, on HF `tokenizers`.

Two vocabulary kinds are understood:
- `gpt2`: byte-level BPE with the file's merges; the split regex is chosen by `tokenizer.ggml.pre`.
- `llama` (SentencePiece-style, as gemma3 uses): BPE with byte fallback over `▁`-spelled text;
  the file has no merges, so they are rebuilt from the vocabulary with the token order as the
  merge priority (Gemma's scores do not follow its merge order; its file order does).

Control tokens (type 3) become special tokens (matched whole in text, dropped by
`decode(skip_special=True)`); user-defined ones (type 4) are matched whole but kept on decode.

Building the 248k-entry Qwen vocabulary takes seconds, so the serialized `tokenizer.json` is
cached on disk under a hash of the file's tokenizer metadata bytes (see `_cache_key`).
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from collections.abc import Iterable, Sequence
from functools import lru_cache

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.gguf import GGUFArray, GGUFFile, GGUFValueType

# Bump when the way a tokenizer is built changes: old cache entries then stop matching.
_BUILDER_VERSION = 1
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

# pre name -> (split regex, split digits one by one first, NFC-normalize, ignore_merges)
_GPT2_PRE: dict[str, tuple[str, bool, bool, bool]] = {
    "default": (_GPT2_SPLIT, False, False, False),
    "gpt2": (_GPT2_SPLIT, False, False, False),
    "smollm": (_GPT2_SPLIT, True, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False, True),
    "llama3": (_LLAMA3_SPLIT, False, False, True),
    "qwen2": (_QWEN2_SPLIT, False, True, False),
    "qwen35": (_QWEN35_SPLIT, False, True, True),  # tiktoken semantics: a whole piece in the vocab wins
}

# Control tokens that end a turn, added to eos_ids when the vocabulary has them.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


def default_cache_dir() -> str:
    home = os.environ.get("PAGELM_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "pagelm")
    return os.path.join(home, "tokenizers")


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[int, str], frozenset[str]]:
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

    def __init__(self, hf, *, bos_id: int | None, eos_ids: tuple[int, ...], add_bos: bool, add_eos: bool,
                 vocab_size: int, name: str = "<tokenizer>", cache_path: str | None = None,
                 from_cache: bool = False):
        self.hf = hf  # the tokenizers.Tokenizer
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos, self.add_eos = add_bos, add_eos
        self.vocab_size = vocab_size
        self.name = name
        self.cache_path = cache_path  # the tokenizer.json this came from or was saved to
        self.from_cache = from_cache
        self.eos_id = eos_ids[0] if eos_ids else None
        self._special_ids = frozenset(
            i for i, t in hf.get_added_tokens_decoder().items() if t.special)

    # ------------------------------------------------------------------------------ building

    @classmethod
    def from_gguf(cls, model: GGUFFile, cache_dir: str | None = None) -> Tokenizer:
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

        cache_dir = default_cache_dir() if cache_dir is None else cache_dir
        path = os.path.join(cache_dir, _cache_key(model) + ".json")
        hf = None
        if os.path.exists(path):
            try:
                hf = HFTokenizer.from_file(path)
            except Exception:  # a damaged entry: rebuild it
                hf = None
        from_cache = hf is not None
        if hf is None:
            token_types = md.get(_PREFIX + "token_type")
            if token_types is not None and len(token_types) != n:
                raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.token_type' has {len(token_types)} "
                                       f"entries, expected {n} (one per token)")
            types = token_types.to_numpy() if token_types is not None else None
            if kind == "gpt2":
                hf = _build_gpt2(model, tokens.tolist(), types, pre)
            else:
                hf = _build_spm(model, tokens.tolist(), types)
            _save_atomic(hf.to_str(), path)

        bos = md.get(_PREFIX + "bos_token_id")
        eos = md.get(_PREFIX + "eos_token_id")
        eot = md.get(_PREFIX + "eot_token_id")
        for key, value in (("bos_token_id", bos), ("eos_token_id", eos), ("eot_token_id", eot)):
            if value is not None and not (isinstance(value, int) and 0 <= value < n):
                raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.{key}' is {value!r}, "
                                       f"expected a token id below {n}")
        eos_ids: list[int] = [i for i in (eos, eot) if i is not None]
        control = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        for text in _END_OF_TURN:
            i = hf.token_to_id(text)
            if i is not None and i in control and i not in eos_ids:
                eos_ids.append(i)
        add_bos = bool(md.get(_PREFIX + "add_bos_token", kind == "llama"))
        add_eos = bool(md.get(_PREFIX + "add_eos_token", False))
        if add_bos and bos is None:
            raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.add_bos_token' is set but "
                                   f"'tokenizer.ggml.bos_token_id' is missing")
        if add_eos and eos is None:
            raise ModelFormatError(f"{model.name}: metadata key 'tokenizer.ggml.add_eos_token' is set but "
                                   f"'tokenizer.ggml.eos_token_id' is missing")
        return cls(hf, bos_id=bos, eos_ids=tuple(dict.fromkeys(eos_ids)), add_bos=add_bos, add_eos=add_eos,
                   vocab_size=n, name=model.name, cache_path=path, from_cache=from_cache)

    # ------------------------------------------------------------------------------ use

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised as such.

        add_special adds BOS / EOS where the file's add_bos_token / add_eos_token ask for them.
        """
        return self._wrap(self.hf.encode(text, add_special_tokens=False).ids, add_special)

    def encode_batch(self, texts: Sequence[str], add_special: bool = False) -> list[list[int]]:
        """encode() of each text, in parallel inside `tokenizers`."""
        return [self._wrap(e.ids, add_special) for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def _wrap(self, ids: list[int], add_special: bool) -> list[int]:
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab {self.vocab_size}, bos {self.bos_id}, eos {self.eos_ids})"


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
    from pagelm.formats.gguf import _skip_strings  # the reader's own prefix walker

    h = hashlib.sha256(f"pagelm-tokenizer/{_BUILDER_VERSION}".encode())
    md = model.metadata
    for key in sorted(k for k in md if k.startswith(_PREFIX)):
        value = md[key]
        h.update(key.encode() + b"\0")
        if isinstance(value, GGUFArray):
            h.update(struct.pack("<BQ", value.element_type, len(value)))
            if value.element_type == GGUFValueType.STRING:
                start = value._start
                end = _skip_strings(value._buf, start, len(value), len(value._buf))
                h.update(value._buf[start:end])
            else:
                h.update(value.to_numpy().tobytes())
        else:
            h.update(repr((type(value).__name__, value)).encode())
        h.update(b"\1")
    return h.hexdigest()[:32]


def _save_atomic(text: str, path: str) -> None:
    """Write `text` to `path` via a unique `.part` file and os.replace (readers never see half a file)."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".part")
    except OSError:
        return  # an unwritable cache only costs the next build its time
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
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
    spelling, alphabet = _byte_alphabet()
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
