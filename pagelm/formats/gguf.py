"""GGUF container: a lazy reader over one read-only mmap, and a streaming writer.

Owns parsing and validating the header, metadata and tensor infos; it never computes on or
decodes tensor data (quantized or not) and never copies it out of the map.
"""

from __future__ import annotations

import contextlib
import os
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from math import prod
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from pagelm.formats.mapped import MappedFile
from pagelm.errors import ModelFormatError, PagelmError, UnsupportedError
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType, row_nbytes

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20
MAX_DIMS = 4
# Each entry becomes Python objects many times larger than its bytes on disk, so the
# counts get a hard cap on top of the bound by the bytes left in the file.
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_T = GGUFValueType
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
STRING_LENGTH = _U64  # the length prefix of a string (GGUFArray.packed_strings)
_SCALAR = {  # fixed-size value types: (struct, little-endian numpy dtype)
    _T.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    _T.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    _T.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    _T.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    _T.UINT32: (_U32, np.dtype("<u4")),
    _T.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    _T.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    _T.BOOL: (struct.Struct("<?"), np.dtype("<u1")),  # any nonzero byte is true
    _T.UINT64: (_U64, np.dtype("<u8")),
    _T.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    _T.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_NUMPY_TYPES = {
    np.uint8: _T.UINT8, np.int8: _T.INT8, np.uint16: _T.UINT16, np.int16: _T.INT16,
    np.uint32: _T.UINT32, np.int32: _T.INT32, np.float32: _T.FLOAT32, np.bool_: _T.BOOL,
    np.uint64: _T.UINT64, np.int64: _T.INT64, np.float64: _T.FLOAT64,
}


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


# ---------------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ne0 first, as stored
    ggml_type: GGMLType
    offset: int  # absolute file offset of the data
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: the dims reversed."""
        return self.dims[::-1]

    @property
    def n_elements(self) -> int:
        return prod(self.dims)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one ne0 row."""
        return row_nbytes(self.ggml_type, self.dims[0])


class _Cursor:
    """Bounds-checked little-endian reads; every failure names the file and byte offset."""

    def __init__(self, buf: memoryview, name: str):
        self.buf, self.name, self.pos, self.size = buf, name, 0, len(buf)

    def error(self, message: str, at: int | None = None) -> ModelFormatError:
        return ModelFormatError(f"{self.name}: {message} (byte offset {self.pos if at is None else at})")

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> int:
        if n > self.left():
            raise self.error(f"{what}: needs {n} bytes, only {self.left()} left before end of file")
        self.pos += n
        return self.pos - n

    def unpack(self, st: struct.Struct, what: str) -> Any:
        return st.unpack_from(self.buf, self.take(st.size, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack(_U64, f"{what} length")
        at = self.take(n, what)
        try:
            return str(self.buf[at : at + n], "utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not valid UTF-8", at) from None


def _skip_strings(buf: memoryview, pos: int, count: int, end: int) -> int | None:
    """Offset just past `count` length-prefixed strings starting at `pos`, or None if they run past `end`."""
    unpack = _U64.unpack_from
    try:
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
    except (struct.error, OverflowError):  # a length ran past the buffer (or past ssize_t)
        return None
    return pos if pos <= end else None


class GGUFArray(Sequence):
    """A metadata array read on demand: numbers as numpy views, strings one at a time.

    Opening a file only walks the string lengths; the offsets index is built on first access.
    """

    def __init__(self, buf: memoryview, where: str, element_type: GGUFValueType, count: int, start: int):
        self._buf, self._where, self._count, self._start = buf, where, count, start
        self.element_type = element_type
        self._offsets: array | None = None  # string arrays: offset of each length prefix

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"GGUFArray({self.element_type.name}, len={self._count})"

    def __getitem__(self, i):
        if isinstance(i, slice):
            if self.element_type == _T.STRING:
                return [self[j] for j in range(*i.indices(self._count))]
            return self.to_numpy()[i].tolist()
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"{self._where}: index {i} out of range for {self._count} elements")
        if self.element_type == _T.STRING:
            return self._string_at(self._index()[i], i)
        st = _SCALAR[self.element_type][0]
        return st.unpack_from(self._buf, self._start + i * st.size)[0]

    def __iter__(self) -> Iterator:
        if self.element_type != _T.STRING:
            yield from self.to_numpy().tolist()
            return
        pos = self._start
        for i in range(self._count):
            yield self._string_at(pos, i)
            pos += 8 + _U64.unpack_from(self._buf, pos)[0]

    def tolist(self) -> list:
        return list(self)

    def packed_strings(self) -> memoryview:
        """A string array's elements as the file holds them, one after another: each a little-endian
        uint64 byte length (STRING_LENGTH) and that many UTF-8 bytes; a view of the map, no copy."""
        if self.element_type != _T.STRING:
            raise UnsupportedError(f"{self._where}: packed_strings() needs a string array, this one holds numbers")
        return self._buf[self._start : _skip_strings(self._buf, self._start, self._count, len(self._buf))]

    def to_numpy(self) -> np.ndarray:
        """A read-only zero-copy view of a numeric array (bool arrays are a converted copy)."""
        if self.element_type == _T.STRING:
            raise UnsupportedError(f"{self._where}: to_numpy() needs a numeric array, this one holds strings")
        dtype = _SCALAR[self.element_type][1]
        view = np.frombuffer(self._buf, dtype, self._count, self._start)
        if self.element_type == _T.BOOL:
            view = view != 0
            view.flags.writeable = False
        return view

    def _index(self) -> array:
        if self._offsets is None:
            offsets, pos, unpack = array("q"), self._start, _U64.unpack_from
            for _ in range(self._count):
                offsets.append(pos)
                pos += 8 + unpack(self._buf, pos)[0]
            self._offsets = offsets
        return self._offsets

    def _string_at(self, pos: int, i: int) -> str:
        n = _U64.unpack_from(self._buf, pos)[0]
        try:
            return str(self._buf[pos + 8 : pos + 8 + n], "utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(f"{self._where} element {i} is not valid UTF-8 (byte offset {pos + 8})") from None


class GGUFFile(MappedFile):
    """A parsed GGUF file. Tensor data and metadata arrays stay in the buffer (the map)."""

    expected = "a GGUF header"

    def _parse(self) -> None:
        cur = _Cursor(self._buf, self.name)
        cur.take(4, "magic")
        magic = bytes(self._buf[:4])
        if magic != MAGIC:
            raise cur.error(f"not a GGUF file: magic {magic!r}, expected {MAGIC!r}", 0)
        version = cur.unpack(_U32, "version")
        if version not in (2, 3):
            if int.from_bytes(version.to_bytes(4, "little"), "big") in (1, 2, 3):
                raise UnsupportedError(f"{self.name}: big-endian GGUF is not supported, only little-endian (byte offset 4)")
            raise UnsupportedError(f"{self.name}: GGUF version {version} is not supported, expected 2 or 3 (byte offset 4)")
        self.version = version

        n_tensors = cur.unpack(_U64, "tensor count")
        n_kv = cur.unpack(_U64, "metadata count")
        for what, n, limit, min_bytes in (
            ("tensor count", n_tensors, MAX_TENSORS, _MIN_TENSOR_INFO_BYTES),
            ("metadata count", n_kv, MAX_KV, _MIN_KV_BYTES),
        ):
            if n > cur.left() // min_bytes:
                raise cur.error(f"{what} {n} cannot fit in the {cur.left()} bytes left (at least {min_bytes} bytes each)")
            if n > limit:
                raise cur.error(f"{what} {n} exceeds the limit of {limit}")

        metadata: dict[str, Any] = {}
        self._types: dict[str, GGUFValueType] = {}
        for _ in range(n_kv):
            at = cur.pos
            key = cur.string("metadata key")
            if key in metadata:
                raise cur.error(f"duplicate metadata key '{key}'", at)
            self._types[key] = vtype = self._value_type(cur, f"metadata key '{key}'")
            metadata[key] = self._read_value(cur, vtype, f"metadata key '{key}'")
        self.metadata: Mapping[str, Any] = MappingProxyType(metadata)

        self.alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in metadata and not (
            self._types["general.alignment"] == _T.UINT32
            and 0 < self.alignment <= MAX_ALIGNMENT
            and self.alignment & (self.alignment - 1) == 0
        ):
            raise ModelFormatError(
                f"{self.name}: metadata key 'general.alignment' is {self.alignment!r:.40} "
                f"({self._types['general.alignment'].name}), expected a UINT32 power of two <= {MAX_ALIGNMENT}"
            )

        raw = []
        for _ in range(n_tensors):
            at = cur.pos
            name = cur.string("tensor name")
            n_dims = cur.unpack(_U32, f"tensor '{name}' n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise cur.error(f"tensor '{name}' has n_dims {n_dims}, expected 1..{MAX_DIMS}", cur.pos - 4)
            dims = tuple(cur.unpack(_U64, f"tensor '{name}' dim {i}") for i in range(n_dims))
            if min(dims) < 1:
                raise cur.error(f"tensor '{name}' has dims {dims}, expected every dim >= 1", cur.pos - 8 * n_dims)
            type_id = cur.unpack(_U32, f"tensor '{name}' type")
            rel = cur.unpack(_U64, f"tensor '{name}' offset")
            raw.append((at, name, dims, type_id, rel))
        self.data_offset = _align(cur.pos, self.alignment)

        self.tensors: dict[str, TensorInfo] = {}
        for at, name, dims, type_id, rel in raw:
            if name in self.tensors:
                raise cur.error(f"duplicate tensor name '{name}'", at)
            self.tensors[name] = self._tensor_info(name, dims, type_id, rel, at)
        end = 0
        for t in sorted(self.tensors.values(), key=lambda t: t.offset):
            if t.offset < end:
                raise ModelFormatError(f"{self.name}: tensor '{t.name}' data at byte offset {t.offset} overlaps the previous tensor, which ends at {end}")
            end = t.offset + t.nbytes

    def _tensor_info(self, name: str, dims: tuple[int, ...], type_id: int, rel: int, at: int) -> TensorInfo:
        where = f"{self.name}: tensor '{name}' (info at byte offset {at})"
        try:
            ggml_type = GGMLType(type_id)
        except ValueError:
            raise UnsupportedError(f"{where}: unknown GGML type id {type_id}") from None
        per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
        if dims[0] % per_block:
            raise ModelFormatError(f"{where}: ne0 {dims[0]} is not a multiple of the {ggml_type.name} block of {per_block}")
        if rel % self.alignment:
            raise ModelFormatError(f"{where}: data offset {rel} is not a multiple of the alignment {self.alignment}")
        offset = self.data_offset + rel
        nbytes = dims[0] // per_block * block_bytes * prod(dims[1:])
        if offset + nbytes > self.file_size:
            raise ModelFormatError(f"{where}: {nbytes} bytes of data at byte offset {offset} run past the end of the file ({self.file_size} bytes)")
        return TensorInfo(name, dims, ggml_type, offset, nbytes)

    def _value_type(self, cur: _Cursor, where: str) -> GGUFValueType:
        type_id = cur.unpack(_U32, f"{where} type")
        try:
            return GGUFValueType(type_id)
        except ValueError:
            raise cur.error(f"{where} has unknown value type {type_id}, expected 0..12", cur.pos - 4) from None

    def _read_value(self, cur: _Cursor, vtype: GGUFValueType, where: str) -> Any:
        if vtype == _T.STRING:
            return cur.string(f"{where} string")
        if vtype != _T.ARRAY:
            return cur.unpack(_SCALAR[vtype][0], where)
        element_type = self._value_type(cur, f"{where} array element")
        if element_type == _T.ARRAY:
            raise UnsupportedError(f"{self.name}: {where} is an array of arrays, which is not supported (byte offset {cur.pos - 4})")
        count = cur.unpack(_U64, f"{where} array count")
        start = cur.pos
        if element_type == _T.STRING:
            if count > cur.left() // 8:
                raise cur.error(f"{where} array count {count} cannot fit in the {cur.left()} bytes left")
            end = _skip_strings(self._buf, start, count, self.file_size)
            if end is None:
                raise cur.error(f"{where}: its {count} strings run past the end of the file")
            cur.pos = end
        else:
            cur.take(count * _SCALAR[element_type][0].size, f"{where} array of {count} {element_type.name}")
        return GGUFArray(self._buf, f"{self.name}: {where}", element_type, count, start)

    def value_type(self, key: str) -> GGUFValueType:
        if key not in self._types:
            raise ModelFormatError(f"{self.name}: metadata key '{key}' missing")
        return self._types[key]

    def require(self, key: str, *types: GGUFValueType) -> Any:
        """The value of `key`, which must be present (and of one of `types`, when given)."""
        vtype = self.value_type(key)
        if types and vtype not in types:
            expected = " or ".join(t.name for t in types)
            raise ModelFormatError(f"{self.name}: metadata key '{key}' has type {vtype.name}, expected {expected}")
        return self.metadata[key]

    def tensor_buffer(self, name: str):
        """(the uint8 array that tensor offsets index, the map under it): the whole file here."""
        return self.data, self.mmap

    def conversion(self, name: str) -> None:
        """GGUF tensors are stored in the convention the models compute with: nothing to convert."""
        return None

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view over the map, no copy."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.name}: no tensor named '{name}'")
        return np.frombuffer(self._buf, np.uint8, info.nbytes, info.offset)


# ---------------------------------------------------------------------------------- writer


@dataclass
class TensorToWrite:
    name: str
    dims: tuple[int, ...]  # ne0 first
    ggml_type: GGMLType
    chunks: Iterable[Any]  # bytes-like, in order; exactly the tensor's byte size in total


class Typed(NamedTuple):
    """A metadata value with an explicit type: Typed(UINT64, 5), Typed(ARRAY, (INT32, [1, 2]))."""

    type: GGUFValueType
    value: Any


def _infer(where: str, value: Any) -> tuple[GGUFValueType, Any]:
    """(type, value) for a metadata value; arrays come back as (ARRAY, (element type, items)).

    bool -> BOOL; int -> UINT32 when 0 <= v < 2**32, else INT32 / INT64 / UINT64, the first
    that fits; float -> FLOAT32; str -> STRING; lists of str / bool / int / float ->
    ARRAY of STRING / BOOL / INT32 / FLOAT32; numpy scalars and 1-D arrays keep their dtype.
    """
    if isinstance(value, Typed):
        vtype = GGUFValueType(value.type)
        if vtype != _T.ARRAY:
            return vtype, value.value
        element_type, items = value.value
        return vtype, (GGUFValueType(element_type), items)
    if isinstance(value, (np.generic, np.ndarray)) and value.dtype.type in _NUMPY_TYPES:
        vtype = _NUMPY_TYPES[value.dtype.type]
        return (vtype, value.item()) if isinstance(value, np.generic) else (_T.ARRAY, (vtype, value))
    if isinstance(value, bool):
        return _T.BOOL, value
    if isinstance(value, int):
        if 0 <= value < 1 << 32:
            return _T.UINT32, value
        if -(1 << 31) <= value < 0:
            return _T.INT32, value
        return (_T.INT64 if -(1 << 63) <= value < 1 << 63 else _T.UINT64), value
    if isinstance(value, float):
        return _T.FLOAT32, value
    if isinstance(value, str):
        return _T.STRING, value
    if isinstance(value, (list, tuple)) and value:
        element_type = _infer_elements(value)
        if element_type is not None:
            return _T.ARRAY, (element_type, value)
    raise PagelmError(f"{where}: cannot infer a GGUF type for {value!r:.60}; wrap it in Typed")


def _infer_elements(items: Sequence[Any]) -> GGUFValueType | None:
    if all(isinstance(v, str) for v in items):
        return _T.STRING
    if all(isinstance(v, bool) for v in items):
        return _T.BOOL
    if any(isinstance(v, bool) for v in items):
        return None
    if all(isinstance(v, int) for v in items):
        return _T.INT32
    if all(isinstance(v, (int, float)) for v in items):
        return _T.FLOAT32
    return None


def _encode_str(where: str, s: Any) -> bytes:
    if not isinstance(s, str):
        raise PagelmError(f"{where}: expected a str, got {type(s).__name__}")
    try:
        b = s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PagelmError(f"{where}: {e}") from None
    return _U64.pack(len(b)) + b


def _encode_kv(path: str, key: str, value: Any) -> bytes:
    where = f"{path}: metadata key '{key}'"
    vtype, value = _infer(where, value)
    out = [_encode_str(f"{path}: metadata key", key), _U32.pack(vtype)]
    element_type, items = value if vtype == _T.ARRAY else (vtype, None)
    try:
        if vtype == _T.STRING:
            out.append(_encode_str(where, value))
        elif vtype != _T.ARRAY:
            out.append(_SCALAR[vtype][0].pack(value))
        else:
            out += [_U32.pack(element_type), _U64.pack(len(items))]
            if element_type == _T.STRING:
                out += [_encode_str(where, s) for s in items]
            elif element_type == _T.ARRAY:
                raise PagelmError(f"{where}: arrays of arrays are not supported")
            elif isinstance(items, np.ndarray) and _NUMPY_TYPES.get(items.dtype.type) == element_type and items.ndim == 1:
                out.append(items.astype(_SCALAR[element_type][1], copy=False).tobytes())
            else:
                out.append(struct.pack(f"<{len(items)}{_SCALAR[element_type][0].format[-1]}", *items))
    except (struct.error, OverflowError, TypeError) as e:
        raise PagelmError(f"{where}: value does not fit {element_type.name}: {e}") from None
    return b"".join(out)


def write_gguf(
    path: str | os.PathLike,
    metadata: Mapping[str, Any],
    tensors: Sequence[TensorToWrite],
    alignment: int = DEFAULT_ALIGNMENT,
    progress: Callable[[int], Any] | None = None,
) -> None:
    """Write a GGUF v3 file, streaming each tensor's chunks; `progress(n)` gets each chunk's size.

    Writes `path + ".part"` and renames it onto `path` (a mapped file is never rewritten in
    place); on any error the .part file is removed.
    """
    path = os.fspath(path)
    if not (0 < alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
        raise PagelmError(f"{path}: alignment {alignment} is not a power of two <= {MAX_ALIGNMENT}")
    if "general.alignment" in metadata:
        raise PagelmError(f"{path}: pass alignment=, not metadata['general.alignment']")
    metadata = dict(metadata)
    if alignment != DEFAULT_ALIGNMENT:
        metadata["general.alignment"] = Typed(_T.UINT32, alignment)

    head = [MAGIC, _U32.pack(3), _U64.pack(len(tensors)), _U64.pack(len(metadata))]
    head += [_encode_kv(path, key, value) for key, value in metadata.items()]
    sizes, offset, names = [], 0, set()
    for t in tensors:
        where = f"{path}: tensor '{t.name}'"
        if t.name in names:
            raise PagelmError(f"{where}: duplicate tensor name")
        names.add(t.name)
        if not 1 <= len(t.dims) <= MAX_DIMS or not all(1 <= d < 1 << 64 for d in t.dims):
            raise PagelmError(f"{where}: dims {t.dims}, expected 1..{MAX_DIMS} dims, each >= 1")
        try:
            nbytes = row_nbytes(t.ggml_type, t.dims[0]) * prod(t.dims[1:])
        except PagelmError as e:
            raise PagelmError(f"{where}: {e}") from e
        head += [_encode_str(where, t.name), _U32.pack(len(t.dims))]
        head += [_U64.pack(d) for d in t.dims] + [_U32.pack(t.ggml_type), _U64.pack(offset)]
        sizes.append(nbytes)
        offset += _align(nbytes, alignment)
    header = b"".join(head)

    part = path + ".part"
    try:
        with open(part, "wb") as f:
            f.write(header + bytes(_align(len(header), alignment) - len(header)))
            for t, nbytes in zip(tensors, sizes):
                written = 0
                for chunk in t.chunks:
                    n = memoryview(chunk).nbytes
                    written += n
                    if written > nbytes:
                        raise PagelmError(f"{path}: tensor '{t.name}': chunks exceed its {nbytes} bytes")
                    f.write(chunk)
                    if progress is not None:
                        progress(n)
                if written != nbytes:
                    raise PagelmError(f"{path}: tensor '{t.name}': chunks hold {written} bytes, expected {nbytes}")
                f.write(bytes(_align(nbytes, alignment) - nbytes))
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(part)
        raise
