"""Fuzz the safetensors reader: every mutated file opens (and every tensor then reads inside
the file) or raises a PagelmError; and a file the safetensors package accepts, we accept with
the same bytes.

Cases run: 1 seed file of 629 bytes x (every truncation + 5 header-length values + 3 byte edits
at every offset + 8 replacements of every JSON number) = 2,825 deterministic files (asserted;
306 of them the package accepts too), plus 3,000 hypothesis examples of 1-4 stacked bit flips,
u32/u64 overwrites, truncations, insertions, deletions and JSON number replacements.
"""

import functools
import re
import struct

import numpy as np
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_gguf_fuzz import apply as apply_byte_edits  # pytest puts this folder on sys.path

from pagelm.errors import PagelmError
from pagelm.formats.safetensors import SafetensorsFile

NUMBER = re.compile(rb"-?\d+")
NUMBER_EDITS = [b"-1", b"0", b"1", b"7", b"2.0", b"1e3", b"18446744073709551616", b"null"]


@functools.cache
def seed_file() -> bytes:
    """A small valid file from the safetensors package: seven dtypes, a scalar, a 0-size tensor."""
    g = torch.Generator().manual_seed(13)
    tensors = {  # names differ in at least two bytes, so no single edit makes a duplicate
        "alpha.f32": torch.randn(2, 3, generator=g),
        "beta.bf16": torch.randn(4, generator=g).to(torch.bfloat16),
        "gamma.f16": torch.randn(1, 3, generator=g).to(torch.float16),
        "delta.i64": torch.tensor([-(2**40), 5]),
        "eps.u8": torch.arange(5, dtype=torch.uint8),
        "zeta.bool": torch.tensor([True, False]),
        "theta.none": torch.zeros(0, 3),
        "iota.one": torch.tensor(1.5, dtype=torch.float64),
    }
    return safetensors.torch.save(tensors, metadata={"format": "pt", "k": "v"})


def reference(data: bytes) -> dict[str, bytes] | None:
    """The safetensors package's tensors (name -> bytes), or None where it rejects the file."""
    try:
        return {name: bytes(t["data"]) for name, t in safetensors.deserialize(data)}
    except Exception:  # the package's own error types vary by version
        return None


def touch_everything(data: bytes, check_reference: bool = True) -> None:
    """Open, then read every tensor; only PagelmError may escape."""
    expected = reference(data) if check_reference else None
    try:
        f = SafetensorsFile.from_buffer(data, "fuzz.safetensors")
    except PagelmError:
        assert expected is None, "the safetensors package opens a file we reject"
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in f.metadata.items())
    for name, info in f.tensors.items():
        assert f.data_offset <= info.offset and info.offset + info.nbytes <= len(data)
        view = f.tensor(name)
        assert view.shape == info.shape and not view.flags.writeable
        raw = np.frombuffer(data, np.uint8, info.nbytes, info.offset)
        if info.dtype == "BOOL":
            np.testing.assert_array_equal(view.ravel(), raw != 0)
        else:
            assert view.tobytes() == raw.tobytes(), name
        if expected is not None:
            assert expected[name] == raw.tobytes(), name
    if expected is not None:
        assert set(expected) == set(f.tensors)
    f.close()


def number_edits(seed: bytes):
    header_end = 8 + struct.unpack_from("<Q", seed)[0]
    for m in NUMBER.finditer(seed, 8, header_end):
        for edit in NUMBER_EDITS:
            yield seed[: m.start()] + edit + seed[m.end() :]


def deterministic_cases(seed: bytes):
    yield from (seed[:n] for n in range(len(seed)))
    header_len = struct.unpack_from("<Q", seed)[0]
    for n in (0, header_len - 1, header_len + 1, len(seed) - 8, 2**64 - 1):
        yield struct.pack("<Q", n) + seed[8:]
    for pos in range(len(seed)):
        for b in (0x00, 0xFF, (seed[pos] + 1) & 0xFF):
            yield seed[:pos] + bytes([b]) + seed[pos + 1 :]
    yield from number_edits(seed)


def test_deterministic_mutations():
    seed = seed_file()
    touch_everything(seed)
    count = 0
    for data in deterministic_cases(seed):
        touch_everything(data)
        count += 1
    assert count == 2_825, count  # update the module docstring if the seed file changes


def apply(seed: bytes, ops) -> bytes:
    """The GGUF fuzzer's byte edits, plus "number": replace the next JSON number after `pos`."""
    data = seed
    for op, pos, arg in ops:
        if op != "number":
            data = apply_byte_edits(data, [(op, pos, arg)])
        elif m := NUMBER.search(data, pos % (len(data) + 1)):
            data = data[: m.start()] + NUMBER_EDITS[arg % len(NUMBER_EDITS)] + data[m.end() :]
    return data


OPS = st.tuples(
    st.sampled_from(["flip", "u32", "u64", "truncate", "insert", "delete", "number"]),
    st.integers(0, 2000),
    st.integers(0, 2**64 - 1),
)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=4))
def test_random_mutations(ops):
    # Stacked edits can make two names equal, which the package may take as last-one-wins.
    touch_everything(apply(seed_file(), ops), check_reference=False)
