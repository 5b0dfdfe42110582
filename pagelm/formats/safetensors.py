"""safetensors container: a hardened reader over one read-only mmap, and sharded checkpoints.

Layout: a little-endian u64 header length N, N bytes of UTF-8 JSON naming each tensor's dtype,
shape and [begin, end) byte range relative to the data region, which follows the header.
Everything in the header is checked against the file before any tensor byte is touched.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from types import MappingProxyType
from typing import Any

import numpy as np

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.mapped import MappedFile

MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors package itself enforces
MAX_INDEX_BYTES = 100 << 20
MAX_RANK = 8
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_U64 = struct.Struct("<Q")

# bf16 and the fp8 formats have no numpy dtype: they come back as their bit patterns.
DTYPES: Mapping[str, np.dtype] = MappingProxyType({
    "BOOL": np.dtype("?"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
})


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # the safetensors name: "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the data
    nbytes: int


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key '{key}'")
        out[key] = value
    return out


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard constant {name}")


def _parse_json(text: bytes | memoryview, where: str, kinds: tuple[type, ...] = (dict,)) -> Any:
    """A JSON object with unique keys (or, where `kinds` allows, a list); anything else (bad UTF-8,
    NaN, nesting that overflows the parser's recursion, over-long integers) is a ModelFormatError
    naming `where`."""
    try:
        value = json.loads(str(text, "utf-8"), object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"{where} is not valid UTF-8 (its byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise ModelFormatError(f"{where} is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(value, kinds):
        expected = " or ".join("an object" if kind is dict else "a list" for kind in kinds)
        raise ModelFormatError(f"{where} is a JSON {type(value).__name__}, expected {expected}")
    return value


def read_json_file(path: str, limit: int, kinds: tuple[type, ...] = (dict,)) -> Any:
    """A JSON object (or, where `kinds` allows, a list) from a file of at most `limit` bytes (an
    index, a config), parsed as strictly as a header; every failure is a ModelFormatError naming the file."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(limit + 1)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot be read ({e.strerror})") from None
    if len(text) > limit:
        raise ModelFormatError(f"{path}: larger than the limit of {limit} bytes")
    return _parse_json(text, path, kinds)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SafetensorsFile(MappedFile):
    """A parsed safetensors file. Tensor data stays in the buffer (the map)."""

    expected = "an 8-byte safetensors header length"

    def _parse(self) -> None:
        if self.file_size < 8:
            raise ModelFormatError(f"{self.name}: {self.file_size} bytes, too short for the 8-byte header length (byte offset 0)")
        header_len = _U64.unpack_from(self._buf, 0)[0]
        if header_len > min(MAX_HEADER_BYTES, self.file_size - 8):
            raise ModelFormatError(
                f"{self.name}: header length {header_len} exceeds the {self.file_size - 8} bytes after it "
                f"or the limit of {MAX_HEADER_BYTES} (byte offset 0)"
            )
        header = _parse_json(self._buf[8 : 8 + header_len], f"{self.name}: header (byte offset 8)")
        self.data_offset = 8 + header_len
        self.data_size = self.file_size - self.data_offset

        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ModelFormatError(f"{self.name}: __metadata__ must be an object of strings, got {json.dumps(metadata)[:100]}")
        self.metadata: Mapping[str, str] = MappingProxyType(metadata)

        self.tensors: dict[str, TensorInfo] = {name: self._tensor_info(name, entry) for name, entry in header.items()}
        end = 0
        for t in sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes)):
            if t.offset < end:
                raise ModelFormatError(f"{self.name}: tensor '{t.name}' data at byte offset {t.offset} overlaps the previous tensor, which ends at {end}")
            end = t.offset + t.nbytes

    def _tensor_info(self, name: str, entry: Any) -> TensorInfo:
        where = f"{self.name}: tensor '{name}'"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ModelFormatError(f"{where}: expected an object with exactly dtype, shape and data_offsets, got {json.dumps(entry)[:100]}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise UnsupportedError(f"{where}: unknown dtype {json.dumps(dtype)[:40]}, expected one of {', '.join(DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(_is_int(d) and d >= 0 for d in shape)):
            raise ModelFormatError(f"{where}: shape {json.dumps(shape)[:100]}, expected at most {MAX_RANK} non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= self.data_size):
            raise ModelFormatError(
                f"{where}: data_offsets {json.dumps(offsets)[:100]}, expected [begin, end] with "
                f"0 <= begin <= end <= {self.data_size} (the data region's size)"
            )
        # numpy refuses a shape whose nonzero dims overflow an int64 even when another dim is 0.
        if prod(max(d, 1) for d in shape) * DTYPES[dtype].itemsize >= 1 << 63:
            raise ModelFormatError(f"{where}: shape {shape} overflows a 64-bit byte count")
        begin, end = offsets
        expected = prod(shape) * DTYPES[dtype].itemsize
        if end - begin != expected:
            raise ModelFormatError(f"{where}: data_offsets {offsets} hold {end - begin} bytes, but {dtype} {shape} needs {expected}")
        return TensorInfo(name, dtype, tuple(shape), self.data_offset + begin, end - begin)

    def info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.name}: no tensor named '{name}'")
        return info

    def file_offset(self, name: str) -> int:
        """Absolute byte offset of the tensor's data in the file."""
        return self.info(name).offset

    def tensor(self, name: str) -> np.ndarray:
        """A read-only zero-copy view over the map (bf16 and fp8 as bit patterns; BOOL is a converted copy)."""
        info = self.info(name)
        stored = np.uint8 if info.dtype == "BOOL" else DTYPES[info.dtype]
        # frombuffer holds an export of the map, so close() cannot unmap it under a live view.
        view = np.frombuffer(self._buf, stored, prod(info.shape), info.offset).reshape(info.shape)
        if info.dtype == "BOOL":
            view = view != 0  # any nonzero byte is true, as in the GGUF reader
            view.flags.writeable = False
        return view


class ShardedSafetensors:
    """The tensors of a checkpoint directory, over one or many shards, each its own map."""

    def __init__(self, name: str, shards: dict[str, SafetensorsFile], owner: dict[str, str]):
        self.name, self.shards, self._owner = name, shards, owner
        self.tensors: dict[str, TensorInfo] = {name: shards[shard].tensors[name] for name, shard in owner.items()}

    @classmethod
    def open(cls, path: str | os.PathLike) -> ShardedSafetensors:
        """`path`: a directory (with an index or a single model.safetensors) or an index file."""
        path = os.fspath(path)
        if os.path.isdir(path):
            directory, index = path, os.path.join(path, INDEX_NAME)
            if not os.path.exists(index):
                single = os.path.join(path, SINGLE_NAME)
                if not os.path.exists(single):
                    raise ModelFormatError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} is in this directory")
                f = SafetensorsFile.open(single)
                return cls(single, {SINGLE_NAME: f}, dict.fromkeys(f.tensors, SINGLE_NAME))
        else:
            directory, index = os.path.dirname(path) or ".", path
        weight_map = _read_weight_map(index)
        shards: dict[str, SafetensorsFile] = {}
        try:
            for shard in sorted(set(weight_map.values())):
                shard_path = os.path.join(directory, shard)
                if not os.path.isfile(shard_path):
                    raise ModelFormatError(f"{index}: shard '{shard}' is missing (expected {shard_path})")
                shards[shard] = f = SafetensorsFile.open(shard_path)
                for name in f.tensors:
                    if weight_map.get(name) != shard:
                        mapped = f"mapped to '{weight_map[name]}'" if name in weight_map else "absent from the weight_map"
                        raise ModelFormatError(f"{shard_path}: holds tensor '{name}', which is {mapped} in {index}")
            for name, shard in weight_map.items():
                if name not in shards[shard].tensors:
                    raise ModelFormatError(f"{index}: tensor '{name}' is mapped to '{shard}', which does not hold it")
        except BaseException:
            for f in shards.values():
                f.close()
            raise
        return cls(index, shards, weight_map)

    def shard_of(self, name: str) -> SafetensorsFile:
        shard = self._owner.get(name)
        if shard is None:
            raise ModelFormatError(f"{self.name}: no tensor named '{name}'")
        return self.shards[shard]

    def file_offset(self, name: str) -> int:
        """Absolute byte offset of the tensor's data in its shard (`shard_of(name).path`)."""
        return self.shard_of(name).file_offset(name)

    def tensor(self, name: str) -> np.ndarray:
        return self.shard_of(name).tensor(name)

    def close(self) -> None:
        for f in self.shards.values():
            f.close()

    def __enter__(self) -> ShardedSafetensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_weight_map(index: str) -> dict[str, str]:
    weight_map = read_json_file(index, MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFormatError(f"{index}: weight_map must be an object mapping tensor names to shard file names")
    for shard in set(weight_map.values()):
        if not shard or shard in (".", "..") or any(c in shard for c in "/\\\0"):
            raise ModelFormatError(f"{index}: shard name {shard!r:.100} is not a plain file name in the index's directory")
    return weight_map


@dataclass(frozen=True)
class TensorToWrite:
    name: str
    dtype: str  # "F32", "F16" or "BF16" (then `values` gives the bit patterns as uint16)
    shape: tuple[int, ...]
    values: Any  # () -> np.ndarray of the shape, produced when its turn to be written comes


def write_safetensors(path: str, tensors: list[TensorToWrite], metadata: dict[str, str] | None = None,
                      progress=None) -> None:
    """Write a safetensors file to `path`.part, then rename it over `path` (never in place).
    Tensors are produced and written one at a time; `progress(nbytes)` after each."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        nbytes = prod(t.shape) * DTYPES[t.dtype].itemsize
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data region starts 8-byte aligned
    part = path + ".part"
    try:
        with open(part, "wb") as fh:
            fh.write(_U64.pack(len(text)) + text)
            for t in tensors:
                values = np.ascontiguousarray(t.values(), DTYPES[t.dtype])
                if values.shape != tuple(t.shape):
                    raise ValueError(f"tensor '{t.name}': produced shape {values.shape}, declared {t.shape}")
                fh.write(values.tobytes())
                if progress is not None:
                    progress(values.nbytes)
        os.replace(part, path)
    except BaseException:
        if os.path.exists(part):
            os.remove(part)
        raise
