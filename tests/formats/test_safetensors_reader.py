"""safetensors reader: files written by the safetensors package as the oracle, sharded
checkpoints, and every malformed header the reader must reject by name."""

import json
import os
import struct

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.safetensors import INDEX_NAME, SafetensorsFile, ShardedSafetensors

rng = np.random.default_rng(13)
ARRAYS = {
    "f32": rng.standard_normal((3, 5)).astype(np.float32),
    "f16": rng.standard_normal((7,)).astype(np.float16),
    "f64": rng.standard_normal((2, 1, 3)).astype(np.float64),
    "i8": rng.integers(-128, 128, (4, 3), dtype=np.int8),
    "u8": rng.integers(0, 256, (5,), dtype=np.uint8),
    "i16": rng.integers(-(2**15), 2**15, (3, 3), dtype=np.int16),
    "i32": rng.integers(-(2**31), 2**31, (2, 2, 2), dtype=np.int32),
    "i64": np.array([-(2**63), 2**63 - 1, 0], dtype=np.int64),
    "bool": np.array([[True, False, True]]),
    "scalar": np.array(2.5, dtype=np.float32),
    "empty": np.zeros((0, 4), dtype=np.float32),
    "odd": rng.standard_normal((1, 3, 1, 5, 1, 2, 1, 1)).astype(np.float32),
}


def raw_file(path, header: dict, data: bytes = b"", header_len: int | None = None) -> str:
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if header_len is None else header_len) + text + data)
    return str(path)


def test_numpy_dtypes_match_the_safetensors_package(tmp_path):
    path = tmp_path / "a.safetensors"
    safetensors.numpy.save_file(ARRAYS, path, metadata={"format": "np", "note": "ünï"})
    with SafetensorsFile.open(path) as f:
        assert dict(f.metadata) == {"format": "np", "note": "ünï"}
        assert set(f.tensors) == set(ARRAYS)
        for name, expected in ARRAYS.items():
            got = f.tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            np.testing.assert_array_equal(got, expected)
            assert not got.flags.writeable
            info = f.tensors[name]
            assert info.nbytes == expected.nbytes and f.file_offset(name) == info.offset
            assert info.offset + info.nbytes <= f.file_size
            assert bytes(f.mmap[info.offset : info.offset + info.nbytes]) == expected.tobytes()


def test_tensor_is_a_view_of_the_map(tmp_path):
    path = tmp_path / "a.safetensors"
    safetensors.numpy.save_file({"w": ARRAYS["f32"]}, path)
    with SafetensorsFile.open(path) as f:
        view = f.tensor("w")
        assert view.base is not None and not view.flags.owndata
        address = view.__array_interface__["data"][0]
        map_start = np.frombuffer(f.mmap, np.uint8).__array_interface__["data"][0]
        assert address == map_start + f.file_offset("w")


def test_bf16_comes_back_as_its_bit_patterns(tmp_path):
    values = torch.randn(4, 6).to(torch.bfloat16)
    path = tmp_path / "b.safetensors"
    safetensors.torch.save_file({"w": values, "v": torch.arange(3, dtype=torch.float16)}, path)
    with SafetensorsFile.open(path) as f:
        assert f.tensors["w"].dtype == "BF16"
        bits = f.tensor("w")
        assert bits.dtype == np.uint16
        np.testing.assert_array_equal(bits, values.view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(f.tensor("v"), np.arange(3, dtype=np.float16))


def test_unknown_name_and_closed_file(tmp_path):
    path = tmp_path / "a.safetensors"
    safetensors.numpy.save_file({"w": ARRAYS["f32"]}, path)
    f = SafetensorsFile.open(path)
    with pytest.raises(ModelFormatError, match=r"a\.safetensors: no tensor named 'nope'"):
        f.tensor("nope")
    view = f.tensor("w")
    f.close()  # a live view keeps the map alive
    np.testing.assert_array_equal(view, ARRAYS["f32"])


def save_sharded(directory, groups: list[dict[str, np.ndarray]]) -> dict[str, str]:
    weight_map = {}
    for i, group in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        safetensors.numpy.save_file(group, directory / shard)
        weight_map |= dict.fromkeys(group, shard)
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return weight_map


def test_sharded_round_trip(tmp_path):
    names = list(ARRAYS)
    weight_map = save_sharded(tmp_path, [{n: ARRAYS[n] for n in names[:5]}, {n: ARRAYS[n] for n in names[5:]}])
    for path in (tmp_path, tmp_path / INDEX_NAME):
        with ShardedSafetensors.open(path) as s:
            assert set(s.tensors) == set(ARRAYS) and len(s.shards) == 2
            for name, expected in ARRAYS.items():
                np.testing.assert_array_equal(s.tensor(name), expected)
                shard = s.shard_of(name)
                assert os.path.basename(shard.path) == weight_map[name]
                assert s.file_offset(name) == shard.file_offset(name) == s.tensors[name].offset


def test_directory_with_one_file(tmp_path):
    safetensors.numpy.save_file({"w": ARRAYS["f32"]}, tmp_path / "model.safetensors")
    with ShardedSafetensors.open(tmp_path) as s:
        np.testing.assert_array_equal(s.tensor("w"), ARRAYS["f32"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="empty: neither model.safetensors.index.json nor model.safetensors"):
        ShardedSafetensors.open(tmp_path / "empty")


def write_index(directory, weight_map) -> None:
    (directory / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    ("weight_map", "message"),
    [
        ({"w": "gone.safetensors"}, r"shard 'gone\.safetensors' is missing"),
        ({"w": "s.safetensors", "x": "s.safetensors"}, r"tensor 'x' is mapped to 's\.safetensors', which does not hold it"),
        ({"x": "s.safetensors"}, r"holds tensor 'w', which is absent from the weight_map"),
        ({"w": "../s.safetensors"}, r"'\.\./s\.safetensors' is not a plain file name"),
        ({"w": "/etc/passwd"}, r"is not a plain file name"),
        ({"w": ".."}, r"is not a plain file name"),
        ({"w": 3}, r"weight_map must be an object"),
    ],
)
def test_bad_index(tmp_path, weight_map, message):
    safetensors.numpy.save_file({"w": ARRAYS["f32"]}, tmp_path / "s.safetensors")
    write_index(tmp_path, weight_map)
    with pytest.raises(ModelFormatError, match=message):
        ShardedSafetensors.open(tmp_path)


def test_bad_shard_and_unknown_name(tmp_path):
    weight_map = save_sharded(tmp_path, [{"w": ARRAYS["f32"]}, {"v": ARRAYS["u8"]}])
    with ShardedSafetensors.open(tmp_path) as s:
        with pytest.raises(ModelFormatError, match=r"index\.json: no tensor named 'nope'"):
            s.tensor("nope")
    (tmp_path / weight_map["v"]).write_bytes(struct.pack("<Q", 99) + b"{}")
    with pytest.raises(ModelFormatError, match=r"model-00002-of-00002\.safetensors: header length 99 exceeds"):
        ShardedSafetensors.open(tmp_path)


def test_tensor_in_two_shards(tmp_path):
    safetensors.numpy.save_file({"w": ARRAYS["f32"]}, tmp_path / "a.safetensors")
    safetensors.numpy.save_file({"w": ARRAYS["f32"]}, tmp_path / "b.safetensors")
    write_index(tmp_path, {"w": "b.safetensors", "x": "a.safetensors"})
    with pytest.raises(ModelFormatError, match=r"a\.safetensors: holds tensor 'w', which is mapped to 'b\.safetensors'"):
        ShardedSafetensors.open(tmp_path)


def test_index_not_json(tmp_path):
    (tmp_path / INDEX_NAME).write_bytes(b"{\"weight_map\": {\"a\": \"b\", \"a\": \"c\"}}")
    with pytest.raises(ModelFormatError, match="not valid JSON: duplicate key 'a'"):
        ShardedSafetensors.open(tmp_path)


F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
OVERFLOW_SHAPE = [0] + [2**62] * 7


@pytest.mark.parametrize(
    ("header", "data", "header_len", "error", "message"),
    [
        ({}, b"", 10**9, ModelFormatError, r"header length 1000000000 exceeds the 2 bytes after it"),
        ([1, 2], b"", None, ModelFormatError, r"header \(byte offset 8\) is a JSON list, expected an object"),
        ({"w": F32_4, "__metadata__": {"a": 1}}, bytes(16), None, ModelFormatError, r"__metadata__ must be an object of strings"),
        ({"w": {**F32_4, "dtype": "F7"}}, bytes(16), None, UnsupportedError, r"tensor 'w': unknown dtype \"F7\""),
        ({"w": {**F32_4, "dtype": 4}}, bytes(16), None, UnsupportedError, r"unknown dtype 4"),
        ({"w": {**F32_4, "shape": [-4]}}, bytes(16), None, ModelFormatError, r"shape \[-4\], expected at most 8 non-negative"),
        ({"w": {**F32_4, "shape": [4.0]}}, bytes(16), None, ModelFormatError, r"shape \[4.0\]"),
        ({"w": {**F32_4, "shape": [True] * 4}}, bytes(16), None, ModelFormatError, r"shape \[true"),
        ({"w": {**F32_4, "shape": [1] * 9}}, bytes(16), None, ModelFormatError, r"expected at most 8"),
        ({"w": {**F32_4, "shape": "4"}}, bytes(16), None, ModelFormatError, r"shape \"4\""),
        ({"w": {**F32_4, "shape": OVERFLOW_SHAPE, "data_offsets": [0, 0]}}, b"", None, ModelFormatError, r"overflows a 64-bit byte count"),
        ({"w": {**F32_4, "data_offsets": [0, 20]}}, bytes(16), None, ModelFormatError, r"0 <= begin <= end <= 16"),
        ({"w": {**F32_4, "data_offsets": [8, 4]}}, bytes(16), None, ModelFormatError, r"data_offsets \[8, 4\]"),
        ({"w": {**F32_4, "data_offsets": [-4, 12]}}, bytes(16), None, ModelFormatError, r"data_offsets \[-4, 12\]"),
        ({"w": {**F32_4, "data_offsets": [0]}}, bytes(16), None, ModelFormatError, r"data_offsets \[0\]"),
        ({"w": {**F32_4, "data_offsets": [0, 12]}}, bytes(16), None, ModelFormatError, r"hold 12 bytes, but F32 \[4\] needs 16"),
        ({"w": {**F32_4, "extra": 1}}, bytes(16), None, ModelFormatError, r"exactly dtype, shape and data_offsets"),
        ({"w": F32_4, "v": {**F32_4, "data_offsets": [8, 24]}}, bytes(24), None, ModelFormatError,
         r"tensor 'v' data at byte offset \d+ overlaps the previous tensor"),
        ({"w": "F32"}, b"", None, ModelFormatError, r"tensor 'w': expected an object"),
    ],
)
def test_bad_header(tmp_path, header, data, header_len, error, message):
    path = raw_file(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(error, match=r"bad\.safetensors: .*" + message):
        SafetensorsFile.open(path)


def test_header_length_over_the_limit(tmp_path):
    path = raw_file(tmp_path / "big.safetensors", {}, header_len=150 << 20)
    os.truncate(path, 200 << 20)  # sparse: the header length fits the file, not the limit
    with pytest.raises(ModelFormatError, match=r"big\.safetensors: header length 157286400 .* the limit of 104857600"):
        SafetensorsFile.open(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b'{"a": 1, "a": 2}', r"duplicate key 'a'"),
        (b"\xff\xfe{}", r"is not valid UTF-8"),
        (b'{"w": NaN}', r"non-standard constant NaN"),
        (b"{", r"not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, r"not valid JSON"),
        (b'{"w": ' + b"9" * 5000 + b"}", r"not valid JSON"),
    ],
)
def test_bad_json(tmp_path, text, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(ModelFormatError, match=r"bad\.safetensors: header \(byte offset 8\) .*" + message):
        SafetensorsFile.open(path)


@pytest.mark.parametrize("content", [b"", b"\x01\x00\x00"])
def test_too_short(tmp_path, content):
    path = tmp_path / "short.safetensors"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError, match=r"short\.safetensors: (empty file|3 bytes, too short)"):
        SafetensorsFile.open(path)


def test_holes_between_tensors_and_trailing_padding_are_accepted(tmp_path):
    header = {"w": F32_4, "v": {"dtype": "U8", "shape": [2], "data_offsets": [20, 22]}}
    data = np.arange(4, dtype=np.float32).tobytes() + bytes(4) + b"\x07\x08" + bytes(3)
    text = json.dumps(header).encode() + b"   "
    path = tmp_path / "gaps.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    with SafetensorsFile.open(path) as f:
        np.testing.assert_array_equal(f.tensor("w"), np.arange(4, dtype=np.float32))
        assert f.tensor("v").tolist() == [7, 8]
