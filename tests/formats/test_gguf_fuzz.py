"""Fuzz the GGUF reader: every mutated or truncated file parses cleanly or raises a PagelmError.

Cases run: 2 seed files (672 and 656 bytes) x (every truncation + 4 u32 and 5 u64 extremes
written at every byte offset + 3 byte edits at every offset) = 17,170 deterministic files
(asserted), plus 6,000 hypothesis examples of 1-4 stacked bit flips, u32/u64 overwrites,
truncations, insertions and deletions: 23,170 files in all.
"""

import functools
import math
import os
import struct
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagelm.errors import PagelmError
from pagelm.formats.gguf import GGUFArray, GGUFFile, GGUFValueType as V, TensorToWrite, Typed, write_gguf
from pagelm.quant.types import GGMLType

U32_EXTREMES = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF]


@functools.cache
def seed_files() -> tuple[bytes, ...]:
    """Two small valid files from our writer: every value type, a string array, three tensors."""
    metadata = {
        "u8": Typed(V.UINT8, 7), "i8": Typed(V.INT8, -7), "u16": Typed(V.UINT16, 700),
        "i16": Typed(V.INT16, -700), "u32": 70_000, "i32": -70_000, "f32": 0.5, "b": True,
        "s": "hé", "u64": Typed(V.UINT64, 2**40), "i64": Typed(V.INT64, -(2**40)),
        "f64": Typed(V.FLOAT64, 0.25), "toks": ["a", "bc", "✓"], "ids": [1, 2, 3],
        "empty": Typed(V.ARRAY, (V.STRING, [])), "flags": [True, False],
    }
    tensors = [
        ("w.f32", (4, 2), GGMLType.F32, 32),
        ("w.q8", (32,), GGMLType.Q8_0, 34),
        ("w.f16", (8,), GGMLType.F16, 16),
    ]
    files = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, alignment in enumerate((32, 16)):
            path = os.path.join(tmp, f"seed{i}.gguf")
            write_gguf(path, metadata, [TensorToWrite(n, d, t, [bytes(range(b))]) for n, d, t, b in tensors], alignment=alignment)
            with open(path, "rb") as f:
                files.append(f.read())
    return tuple(files)


def touch_everything(data: bytes) -> None:
    """Parse, then read every metadata value, array element and tensor; only PagelmError may escape."""
    try:
        f = GGUFFile.from_buffer(data, "fuzz.gguf")
    except PagelmError:
        return
    for key, value in f.metadata.items():
        assert f.require(key, f.value_type(key)) is value
        if isinstance(value, GGUFArray):
            try:
                items = [value[i] for i in range(len(value))]
                assert value.tolist() == items
                if value.element_type != V.STRING:
                    assert value.to_numpy().shape == (len(value),)
            except PagelmError:
                pass
    for name, info in f.tensors.items():
        assert info.offset % f.alignment == 0 and info.offset + info.nbytes <= len(data)
        assert f.tensor_data(name).nbytes == info.nbytes == info.row_nbytes * math.prod(info.dims[1:])
    f.close()


def deterministic_cases(seed: bytes):
    yield from (seed[:n] for n in range(len(seed)))
    for pos in range(len(seed)):
        for fmt, values in (("<I", U32_EXTREMES), ("<Q", [0, 2**32, 2**63, 2**64 - 1, len(seed)])):
            if pos + struct.calcsize(fmt) <= len(seed):
                for v in values:
                    yield seed[:pos] + struct.pack(fmt, v) + seed[pos + struct.calcsize(fmt) :]
        for b in (0x00, 0xFF, (seed[pos] + 1) & 0xFF):
            yield seed[:pos] + bytes([b]) + seed[pos + 1 :]


def test_deterministic_mutations():
    count = 0
    for seed in seed_files():
        touch_everything(seed)
        for data in deterministic_cases(seed):
            touch_everything(data)
            count += 1
    assert count == 17_170, count  # update the module docstring if the seed files change


def apply(seed: bytes, ops) -> bytes:
    data = bytearray(seed)
    for op, pos, arg in ops:
        pos %= len(data) + 1
        if op == "flip" and pos < len(data):
            data[pos] ^= 1 << (arg % 8)
        elif op == "u32":
            data[pos : pos + 4] = struct.pack("<I", U32_EXTREMES[arg % 4] if arg < 8 else arg & 0xFFFFFFFF)
        elif op == "u64":
            data[pos : pos + 8] = struct.pack("<Q", [0, 2**63, 2**64 - 1, len(seed)][arg % 4] if arg < 8 else arg)
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = arg.to_bytes(8, "little")[: 1 + arg % 8]
        elif op == "delete":
            del data[pos : pos + 1 + arg % 16]
    return bytes(data)


OPS = st.tuples(
    st.sampled_from(["flip", "u32", "u64", "truncate", "insert", "delete"]),
    st.integers(0, 2000),
    st.integers(0, 2**64 - 1),
)


@settings(max_examples=6000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 1), ops=st.lists(OPS, min_size=1, max_size=4))
def test_random_mutations(which, ops):
    touch_everything(apply(seed_files()[which], ops))
