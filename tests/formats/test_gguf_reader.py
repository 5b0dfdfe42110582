"""GGUF reader and writer: round trips, gguf-py as the independent reference, malformed files."""

import math
import os
import random
import struct
import tracemalloc

import gguf
import numpy as np
import pytest

from pagelm.errors import ModelFormatError, PagelmError, UnsupportedError
from pagelm.formats.gguf import (
    STRING_LENGTH,
    GGUFArray,
    GGUFFile,
    GGUFValueType as V,
    TensorToWrite,
    Typed,
    write_gguf,
)
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType

SCALARS = [
    (V.UINT8, [0, 255]),
    (V.INT8, [-128, 127]),
    (V.UINT16, [0, 65535]),
    (V.INT16, [-32768, 32767]),
    (V.UINT32, [0, 2**32 - 1]),
    (V.INT32, [-(2**31), 2**31 - 1]),
    (V.FLOAT32, [0.0, -1.5, 3.4028234663852886e38, math.inf]),
    (V.BOOL, [False, True]),
    (V.STRING, ["", "ascii", "ünïcødé ✓ 𝄞 中文"]),
    (V.UINT64, [0, 2**64 - 1]),
    (V.INT64, [-(2**63), 2**63 - 1]),
    (V.FLOAT64, [0.0, -1e300, 5e-324]),
]


def nbytes_of(ggml_type, dims):
    per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
    return dims[0] // per_block * block_bytes * math.prod(dims[1:])


def random_bytes(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


TENSORS = [  # (name, dims ne0-first, type)
    ("f32.4d", (2, 3, 1, 2), GGMLType.F32),
    ("f16", (7,), GGMLType.F16),
    ("bf16", (3, 5), GGMLType.BF16),
    ("q8_0", (64, 3), GGMLType.Q8_0),
    ("q4_k", (256, 2), GGMLType.Q4_K),
    ("q6_k", (512, 1), GGMLType.Q6_K),
    ("i8", (5, 2, 3), GGMLType.I8),
]


def tensor_payloads():
    return {name: random_bytes(nbytes_of(t, dims), seed=i) for i, (name, dims, t) in enumerate(TENSORS)}


def chunked(data):
    """The same bytes as bytes, a numpy array and a memoryview, to exercise every bytes-like."""
    a, b = len(data) // 3, 2 * len(data) // 3
    return [data[:a], np.frombuffer(data[a:b], np.uint8), memoryview(data)[b:]]


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("vtype,values", SCALARS, ids=[t.name for t, _ in SCALARS])
def test_scalar_round_trip(tmp_path, vtype, values):
    path = tmp_path / "m.gguf"
    write_gguf(path, {f"k{i}": Typed(vtype, v) for i, v in enumerate(values)}, [])
    with GGUFFile.open(path) as f:
        for i, v in enumerate(values):
            assert f.value_type(f"k{i}") == vtype
            got = f.require(f"k{i}", vtype)
            assert type(got) is type(v) and got == v
        assert f.tensors == {}


def test_inferred_types(tmp_path):
    path = tmp_path / "m.gguf"
    metadata = {
        "bool": True, "u32": 2**32 - 1, "i32": -5, "i64.neg": -(2**40), "i64.big": 2**40,
        "u64": 2**64 - 1, "float": 0.25, "str": "s", "strs": ["a", "ß"], "ints": [1, -2],
        "floats": [1.5, 2], "bools": [True, False], "np.u16": np.uint16(7),
        "np.arr": np.arange(4, dtype=np.int16), "np.big": np.arange(3, dtype=">u8"),
    }
    expected = {
        "bool": V.BOOL, "u32": V.UINT32, "i32": V.INT32, "i64.neg": V.INT64, "i64.big": V.INT64,
        "u64": V.UINT64, "float": V.FLOAT32, "str": V.STRING, "strs": (V.ARRAY, V.STRING),
        "ints": (V.ARRAY, V.INT32), "floats": (V.ARRAY, V.FLOAT32), "bools": (V.ARRAY, V.BOOL),
        "np.u16": V.UINT16, "np.arr": (V.ARRAY, V.INT16), "np.big": (V.ARRAY, V.UINT64),
    }
    write_gguf(path, metadata, [])
    with GGUFFile.open(path) as f:
        for key, want in expected.items():
            value = f.metadata[key]
            if isinstance(want, tuple):
                assert f.value_type(key) == V.ARRAY and value.element_type == want[1]
                assert value.tolist() == list(np.asarray(metadata[key]).tolist())
            else:
                assert f.value_type(key) == want and value == metadata[key]


@pytest.mark.parametrize("vtype,values", SCALARS, ids=[t.name for t, _ in SCALARS])
def test_array_round_trip(tmp_path, vtype, values):
    path = tmp_path / "m.gguf"
    items = values * 3
    write_gguf(path, {"a": Typed(V.ARRAY, (vtype, items)), "empty": Typed(V.ARRAY, (vtype, []))}, [])
    with GGUFFile.open(path) as f:
        a, empty = f.require("a", V.ARRAY), f.require("empty", V.ARRAY)
        assert isinstance(a, GGUFArray) and a.element_type == vtype == empty.element_type
        assert len(a) == len(items) and len(empty) == 0
        assert a.tolist() == list(a) == items and empty.tolist() == []
        assert [a[i] for i in range(len(items))] == items
        assert a[-1] == items[-1] and a[1::2] == items[1::2] and a[::-1] == items[::-1]
        with pytest.raises(IndexError):
            a[len(items)]
        if vtype == V.STRING:
            with pytest.raises(UnsupportedError, match="strings"):
                a.to_numpy()
            packed = b"".join(STRING_LENGTH.pack(len(v.encode())) + v.encode() for v in items)
            assert bytes(a.packed_strings()) == packed and bytes(empty.packed_strings()) == b""
        else:
            arr = a.to_numpy()
            assert arr.tolist() == items and not arr.flags.writeable
            assert empty.to_numpy().shape == (0,)
            with pytest.raises(UnsupportedError, match="numbers"):
                a.packed_strings()


@pytest.mark.parametrize("alignment", [32, 64, 1, 4096])
def test_tensor_round_trip(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    payloads = tensor_payloads()
    seen = []
    write_gguf(
        path,
        {"general.architecture": "test"},
        [TensorToWrite(name, dims, t, chunked(payloads[name])) for name, dims, t in TENSORS],
        alignment=alignment,
        progress=seen.append,
    )
    assert sum(seen) == sum(map(len, payloads.values()))
    assert not os.path.exists(f"{path}.part")
    with GGUFFile.open(path) as f:
        assert (f.version, f.alignment, f.file_size) == (3, alignment, os.path.getsize(path))
        assert ("general.alignment" in f.metadata) == (alignment != 32)
        assert list(f.tensors) == [name for name, _, _ in TENSORS]
        for name, dims, t in TENSORS:
            info = f.tensors[name]
            assert (info.name, info.dims, info.ggml_type) == (name, dims, t)
            assert info.shape == dims[::-1] and info.n_elements == math.prod(dims)
            assert info.nbytes == len(payloads[name]) and info.row_nbytes == nbytes_of(t, dims[:1])
            assert info.offset % alignment == 0 and info.offset >= f.data_offset
            data = f.tensor_data(name)
            assert data.dtype == np.uint8 and data.shape == (info.nbytes,) and not data.flags.writeable
            assert data.tobytes() == payloads[name]
        with pytest.raises(ModelFormatError, match="no tensor named 'nope'"):
            f.tensor_data("nope")
        assert f.mmap is not None


def test_from_buffer_matches_open(tmp_path):
    path = tmp_path / "m.gguf"
    payloads = tensor_payloads()
    write_gguf(path, {"x": [1, 2]}, [TensorToWrite(n, d, t, [payloads[n]]) for n, d, t in TENSORS])
    f = GGUFFile.from_buffer(bytearray(path.read_bytes()))
    assert f.name == "<buffer>" and f.mmap is None and f.path is None
    with GGUFFile.open(path) as g:
        assert f.tensors == g.tensors and f.metadata["x"].tolist() == g.metadata["x"].tolist()
    assert not f.tensor_data("q8_0").flags.writeable


def test_close_with_live_views(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, {"a": [1, 2, 3]}, [TensorToWrite("t", (4,), GGMLType.F32, [bytes(16)])])
    f = GGUFFile.open(path)
    data, arr = f.tensor_data("t"), f.metadata["a"].to_numpy()
    f.close()  # views keep the map alive; close must not raise
    assert data.tobytes() == bytes(16) and arr.tolist() == [1, 2, 3]
    with GGUFFile.open(path) as g:
        pass
    g.close()  # closing twice is harmless


def test_require_errors(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, {"n": 3}, [])
    with GGUFFile.open(path) as f:
        with pytest.raises(ModelFormatError, match=r"m\.gguf: metadata key 'missing' missing"):
            f.require("missing")
        with pytest.raises(ModelFormatError, match="'n' has type UINT32, expected STRING or UINT64"):
            f.require("n", V.STRING, V.UINT64)
        assert f.require("n", V.UINT32, V.INT32) == 3


# ------------------------------------------------------------------------------ gguf-py reference


def test_gguf_py_writer_to_our_reader(tmp_path):
    path = tmp_path / "ref.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint8("u8", 200)
    w.add_int16("i16", -300)
    w.add_uint32("u32", 7)
    w.add_int64("i64", -(2**40))
    w.add_uint64("u64", 2**63)
    w.add_float32("f32", 0.5)
    w.add_float64("f64", 1e-300)
    w.add_bool("b", True)
    w.add_string("s", "grüße")
    tokens = [f"tok{i}·" for i in range(1000)]
    w.add_array("tokens", tokens)
    w.add_key_value("scores", [float(i) / 7 for i in range(100)], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
    w.add_key_value("u64s", [1, 2**64 - 1], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64)
    w.add_custom_alignment(64)
    f32 = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    q8 = np.frombuffer(random_bytes(3 * 34), np.uint8).reshape(3, 34)
    q4k = np.frombuffer(random_bytes(2 * 144, seed=1), np.uint8).reshape(1, 288)
    w.add_tensor("f32", f32)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q4k", q4k, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with GGUFFile.open(path) as f:
        m = f.metadata
        assert m["general.architecture"] == "llama" and f.alignment == 64
        assert (m["u8"], m["i16"], m["u32"], m["i64"], m["u64"]) == (200, -300, 7, -(2**40), 2**63)
        assert m["f32"] == 0.5 and m["f64"] == 1e-300 and m["b"] is True and m["s"] == "grüße"
        assert f.value_type("u8") == V.UINT8 and f.value_type("f64") == V.FLOAT64
        assert m["tokens"].tolist() == tokens and m["tokens"][777] == "tok777·"
        assert m["scores"].tolist() == [float(np.float32(i / 7)) for i in range(100)]
        assert m["u64s"].tolist() == [1, 2**64 - 1]
        assert f.tensors["f32"].dims == (4, 3, 2) and f.tensors["f32"].shape == (2, 3, 4)
        assert f.tensor_data("f32").view(np.float32).tolist() == f32.ravel().tolist()
        assert f.tensors["q8"].dims == (32, 3) and f.tensors["q8"].ggml_type == GGMLType.Q8_0
        assert f.tensor_data("q8").tobytes() == q8.tobytes()
        assert f.tensors["q4k"].dims == (512, 1) and f.tensor_data("q4k").tobytes() == q4k.tobytes()


def test_our_writer_to_gguf_py_reader(tmp_path):
    path = tmp_path / "ours.gguf"
    payloads = tensor_payloads()
    metadata = {f"scalar.{t.name}": Typed(t, vs[-1]) for t, vs in SCALARS}
    metadata |= {f"array.{t.name}": Typed(V.ARRAY, (t, vs * 2)) for t, vs in SCALARS}
    metadata["tokens"] = [f"t{i}✓" for i in range(500)]
    write_gguf(path, metadata, [TensorToWrite(n, d, t, chunked(payloads[n])) for n, d, t in TENSORS], alignment=64)

    r = gguf.GGUFReader(path)
    assert r.alignment == 64
    fields = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(metadata) | {"general.alignment"}
    for t, vs in SCALARS:
        scalar, array = fields[f"scalar.{t.name}"], fields[f"array.{t.name}"]
        assert scalar.types == [gguf.GGUFValueType(t)] and array.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(t)]
        assert scalar.contents() == vs[-1] and array.contents() == vs * 2
    assert fields["tokens"].contents() == metadata["tokens"]
    assert [t.name for t in r.tensors] == [n for n, _, _ in TENSORS]
    with GGUFFile.open(path) as f:
        for t in r.tensors:
            ours = f.tensors[t.name]
            assert t.tensor_type == ours.ggml_type and tuple(t.shape.tolist()) == ours.dims
            assert t.n_bytes == ours.nbytes and t.data_offset == ours.offset
            assert t.data.tobytes() == payloads[t.name]


# ------------------------------------------------------------------------------ laziness


def test_lazy_string_array(tmp_path):
    path = tmp_path / "vocab.gguf"
    rng = random.Random(1)
    alphabet = "abcxyz ĠĊ中文✓🙂\n\x00"
    strings = ["".join(rng.choices(alphabet, k=rng.randrange(0, 9))) for _ in range(20_000)]
    write_gguf(path, {"before": 1, "tokens": strings, "after": "end"}, [])
    with GGUFFile.open(path) as f:
        tokens = f.metadata["tokens"]
        assert len(tokens) == len(strings) and f.metadata["after"] == "end"
        for i in rng.sample(range(len(strings)), 500) + [0, len(strings) - 1]:
            assert tokens[i] == strings[i] and tokens[i - len(strings)] == strings[i]
        assert tokens[100:120] == strings[100:120] and list(tokens) == strings
        assert tokens.index(strings[42]) == strings.index(strings[42])


def test_open_does_not_materialize_strings(tmp_path):
    path = tmp_path / "vocab.gguf"
    write_gguf(path, {"tokens": [f"token{i}" for i in range(248_320)], "merges": [f"a{i} b" for i in range(250_000)]}, [])
    tracemalloc.start()
    try:
        f = GGUFFile.open(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # an object per string would be tens of MiB
    assert f.metadata["tokens"][248_319] == "token248319" and f.metadata["merges"][3] == "a3 b"
    f.close()


# ------------------------------------------------------------------------------ writer errors


def test_writer_rejects_wrong_byte_total_and_cleans_up(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"previous")
    for chunks in ([bytes(15)], [bytes(16), b"x"]):
        with pytest.raises(PagelmError, match="tensor 't'.*16"):
            write_gguf(path, {}, [TensorToWrite("t", (4,), GGMLType.F32, chunks)])
        assert path.read_bytes() == b"previous" and not os.path.exists(f"{path}.part")

    def failing():
        yield bytes(8)
        raise RuntimeError("generator failed")

    with pytest.raises(RuntimeError):
        write_gguf(path, {}, [TensorToWrite("t", (4,), GGMLType.F32, failing())])
    assert path.read_bytes() == b"previous" and not os.path.exists(f"{path}.part")


@pytest.mark.parametrize(
    "metadata,tensors,alignment,match",
    [
        ({"general.alignment": 64}, [], 32, "alignment="),
        ({}, [], 48, "power of two"),
        ({"k": object()}, [], 32, "'k': cannot infer"),
        ({"k": []}, [], 32, "'k': cannot infer"),
        ({"k": [1, "a"]}, [], 32, "'k': cannot infer"),
        ({"k": Typed(V.UINT8, 256)}, [], 32, "'k'.*UINT8"),
        ({"k": Typed(V.ARRAY, (V.INT8, [1, 200]))}, [], 32, "'k'"),
        ({"k": Typed(V.ARRAY, (V.ARRAY, [[1]]))}, [], 32, "arrays of arrays"),
        ({"k": "\udc80"}, [], 32, "'k'"),
        ({}, [TensorToWrite("q", (33,), GGMLType.Q8_0, [])], 32, "tensor 'q'"),
        ({}, [TensorToWrite("q", (0,), GGMLType.F32, [])], 32, "tensor 'q'.*dims"),
        ({}, [TensorToWrite("q", (1, 1, 1, 1, 1), GGMLType.F32, [])], 32, "tensor 'q'.*dims"),
        ({}, [TensorToWrite("q", (1,), GGMLType.F32, [bytes(4)])] * 2, 32, "duplicate"),
    ],
)
def test_writer_rejects_bad_input(tmp_path, metadata, tensors, alignment, match):
    path = tmp_path / "m.gguf"
    with pytest.raises(PagelmError, match=match):
        write_gguf(path, metadata, tensors, alignment=alignment)
    assert not os.path.exists(path) and not os.path.exists(f"{path}.part")


# ------------------------------------------------------------------------------ malformed files


def u32(v):
    return struct.pack("<I", v)


def u64(v):
    return struct.pack("<Q", v)


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key, vtype, payload):
    return gstr(key) + u32(vtype) + payload


def tinfo(name, dims, type_id, offset):
    return gstr(name) + u32(len(dims)) + b"".join(map(u64, dims)) + u32(type_id) + u64(offset)


def raw_gguf(kvs=(), infos=(), data=b"", version=3, n_kv=None, n_tensors=None, alignment=32):
    head = b"GGUF" + u32(version) + u64(len(infos) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


def expect(data, exc, *parts):
    with pytest.raises(exc) as e:
        GGUFFile.from_buffer(data, name="bad.gguf")
    message = str(e.value)
    assert message.startswith("bad.gguf: "), message
    for part in parts:
        assert part in message, message
    return message


def test_valid_raw_file_parses():
    data = raw_gguf([kv("k", V.UINT32, u32(5))], [tinfo("t", (8,), GGMLType.F32, 0)], bytes(32))
    f = GGUFFile.from_buffer(data)
    assert f.metadata["k"] == 5 and f.tensors["t"].offset == f.data_offset and f.version == 3
    assert GGUFFile.from_buffer(raw_gguf(version=2)).version == 2


MALFORMED = {
    "empty": (b"", ModelFormatError, "magic", "needs 4 bytes"),
    "bad magic": (b"GGML" + bytes(20), ModelFormatError, "not a GGUF file"),
    "truncated header": (b"GGUF\x03\x00", ModelFormatError, "version", "byte offset 4"),
    "truncated counts": (b"GGUF" + u32(3) + u64(0) + b"\x00", ModelFormatError, "metadata count", "byte offset 16"),
    "version 1": (b"GGUF" + u32(1) + bytes(16), UnsupportedError, "version 1", "expected 2 or 3"),
    "version 4": (b"GGUF" + u32(4) + bytes(16), UnsupportedError, "version 4"),
    "big-endian": (b"GGUF" + struct.pack(">I", 3) + bytes(16), UnsupportedError, "big-endian"),
    "huge tensor count": (raw_gguf(n_tensors=2**64 - 1), ModelFormatError, "tensor count 18446744073709551615"),
    "huge kv count": (raw_gguf(n_kv=2**63), ModelFormatError, "metadata count 9223372036854775808"),
    "huge key length": (raw_gguf([u64(2**64 - 1) + b"abcd" * 8], n_kv=1), ModelFormatError, "metadata key", "18446744073709551615"),
    "huge string length": (raw_gguf([kv("name", V.STRING, u64(2**62) + b"abc")]), ModelFormatError, "'name' string", "4611686018427387904"),
    "huge array count": (raw_gguf([kv("arr", V.ARRAY, u32(V.UINT64) + u64(2**61) + bytes(16))]), ModelFormatError, "'arr' array", "2305843009213693952"),
    "huge string array count": (raw_gguf([kv("toks", V.ARRAY, u32(V.STRING) + u64(2**40) + gstr("a"))]), ModelFormatError, "'toks' array count"),
    "string array past end": (raw_gguf([kv("toks", V.ARRAY, u32(V.STRING) + u64(2) + gstr("a") + u64(2**64 - 1))]), ModelFormatError, "'toks'", "past the end"),
    "array of arrays": (raw_gguf([kv("nest", V.ARRAY, u32(V.ARRAY) + u64(0))]), UnsupportedError, "'nest'", "array of arrays"),
    "unknown value type": (raw_gguf([kv("k", 13, u32(0))]), ModelFormatError, "'k'", "unknown value type 13"),
    "unknown element type": (raw_gguf([kv("k", V.ARRAY, u32(99) + u64(0))]), ModelFormatError, "'k' array element", "99"),
    "duplicate key": (raw_gguf([kv("k", V.UINT8, b"\x01")] * 2), ModelFormatError, "duplicate metadata key 'k'"),
    "bad utf-8 key": (raw_gguf([kv(b"k\xff", V.UINT8, b"\x01")]), ModelFormatError, "metadata key is not valid UTF-8", "byte offset 32"),
    "bad utf-8 value": (raw_gguf([kv("k", V.STRING, gstr(b"\xc3\x28"))]), ModelFormatError, "'k' string is not valid UTF-8"),
    "bad utf-8 tensor name": (raw_gguf(infos=[tinfo(b"\xe2\x82", (1,), 0, 0)], data=bytes(32)), ModelFormatError, "tensor name is not valid UTF-8"),
    "alignment not a power of two": (raw_gguf([kv("general.alignment", V.UINT32, u32(48))]), ModelFormatError, "'general.alignment'", "48", "power of two"),
    "alignment zero": (raw_gguf([kv("general.alignment", V.UINT32, u32(0))]), ModelFormatError, "'general.alignment'"),
    "alignment too large": (raw_gguf([kv("general.alignment", V.UINT32, u32(1 << 21))]), ModelFormatError, "'general.alignment'"),
    "alignment wrong type": (raw_gguf([kv("general.alignment", V.UINT64, u64(64))]), ModelFormatError, "'general.alignment'", "UINT64", "expected a UINT32"),
    "misaligned offset": (raw_gguf(infos=[tinfo("w", (4,), 0, 8)], data=bytes(64)), ModelFormatError, "tensor 'w'", "offset 8", "alignment 32"),
    "tensor past EOF": (raw_gguf(infos=[tinfo("w", (16,), 0, 0)], data=bytes(32)), ModelFormatError, "tensor 'w'", "64 bytes", "past the end"),
    "huge offset": (raw_gguf(infos=[tinfo("w", (1,), 0, 2**64 - 32)], data=bytes(32)), ModelFormatError, "tensor 'w'", "past the end"),
    "huge dims": (raw_gguf(infos=[tinfo("w", (2**63, 2**63, 2**63, 2**63), 0, 0)], data=bytes(32)), ModelFormatError, "tensor 'w'", "past the end"),
    "overlapping tensors": (raw_gguf(infos=[tinfo("a", (16,), 0, 0), tinfo("b", (8,), 0, 32)], data=bytes(96)), ModelFormatError, "tensor 'b'", "overlaps"),
    "duplicate tensor": (raw_gguf(infos=[tinfo("a", (1,), 0, 0), tinfo("a", (1,), 0, 32)], data=bytes(64)), ModelFormatError, "duplicate tensor name 'a'"),
    "unknown ggml type": (raw_gguf(infos=[tinfo("w", (4,), 4, 0)], data=bytes(32)), UnsupportedError, "tensor 'w'", "GGML type id 4"),
    "ne0 not a block multiple": (raw_gguf(infos=[tinfo("w", (33,), GGMLType.Q8_0, 0)], data=bytes(64)), ModelFormatError, "tensor 'w'", "ne0 33", "Q8_0"),
    "n_dims zero": (raw_gguf(infos=[gstr("w") + u32(0) + u32(0) + u64(0)], data=bytes(32)), ModelFormatError, "tensor 'w'", "n_dims 0"),
    "n_dims five": (raw_gguf(infos=[tinfo("w", (1,) * 5, 0, 0)], data=bytes(32)), ModelFormatError, "tensor 'w'", "n_dims 5"),
    "zero dim": (raw_gguf(infos=[tinfo("w", (4, 0), 0, 0)], data=bytes(32)), ModelFormatError, "tensor 'w'", "every dim >= 1"),
    "truncated tensor info": (raw_gguf(infos=[tinfo("weight.long.name", (4,), 0, 0)[:-4]], alignment=1), ModelFormatError, "tensor 'weight.long.name' offset", "needs 8 bytes"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed(case):
    data, exc, *parts = MALFORMED[case]
    expect(data, exc, *parts)


def test_bad_utf8_in_string_array_is_raised_on_access():
    data = raw_gguf([kv("toks", V.ARRAY, u32(V.STRING) + u64(3) + gstr("ok") + gstr(b"\xff") + gstr("fine"))])
    toks = GGUFFile.from_buffer(data, "bad.gguf").metadata["toks"]
    assert toks[0] == "ok" and toks[2] == "fine"
    with pytest.raises(ModelFormatError, match=r"bad\.gguf: metadata key 'toks' element 1 is not valid UTF-8"):
        toks[1]
    with pytest.raises(ModelFormatError, match="element 1"):
        toks.tolist()


def test_open_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="empty.gguf: empty file"):
        GGUFFile.open(path)
