"""A model file mapped read-only: opening, the buffer every reader parses in place, closing.

Each container's reader (GGUF, safetensors) subclasses MappedFile and implements `_parse`.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from pagelm.errors import ModelFormatError


class MappedFile:
    """A file's bytes as a read-only memoryview over its map (or over a buffer, for tests)."""

    expected = "a header"  # what an empty file lacks, for its error message

    def __init__(self, buf: memoryview, name: str, mm: mmap.mmap | None = None, path: str | None = None,
                 size: int | None = None):
        self.name, self.path, self.mmap, self._buf = name, path, mm, buf
        self.file_size = len(buf) if size is None else size
        self._parse()

    def _parse(self) -> None:
        raise NotImplementedError

    @classmethod
    def open(cls, path: str | os.PathLike, size: int | None = None):
        """The file at `path`; `size`: the whole file's size where `path` holds only its beginning (a download
        in progress): the header is parsed (an error if it has not all arrived), no tensor data may be read."""
        name = os.fspath(path)
        with open(name, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                raise ModelFormatError(f"{name}: empty file, expected {cls.expected} (byte offset 0)")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(mm)
        try:
            return cls(buf, name, mm, name, size)
        except BaseException:
            release(buf, mm)
            raise

    @classmethod
    def from_buffer(cls, buf, name: str = "<buffer>"):
        return cls(memoryview(buf).cast("B").toreadonly(), name)

    @property
    def data(self):
        """The whole file as a read-only uint8 array over the map, no copy (tensor offsets index it)."""
        return np.frombuffer(self._buf, np.uint8)

    def close(self) -> None:
        release(self._buf, self.mmap)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def release(buf: memoryview, mm: mmap.mmap | None) -> None:
    try:
        buf.release()
        if mm is not None:
            mm.close()
    except BufferError:
        pass  # numpy views still point into the map; it is unmapped when the last one is freed
