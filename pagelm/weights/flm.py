"""FastFlowLM model directories seen the way the models read a GGUF file, with no copy.

A FastFlowLM directory holds config.json (Hugging Face's keys, plus `flm_version`), model.q4nx
(a safetensors container: tiled matrices as I8 [N/32, K/256, tile bytes], see `quant.tiles`;
other tensors BF16 or F32), tokenizer files and a chat template. Names and conventions are
Hugging Face's (`weights.hf`), except that norm weights have the +1 folded in (GGUF's
convention), each architecture's `FLM_NAMES` renames and `flm_rows` row orders (Qwen3.5: the
DeltaNet alpha/beta projections, and an attention q_proj that is planar: all query rows, then
all gate rows), and a tied model's only copy of the embeddings is `lm_head.weight`. A matrix of
fewer rows than its last 32-row group repeats its rows to fill it; a `.bf16.weight` copy beside
it holds the real rows, and checks the tile decoder (`check_copies`).
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass, replace

import numpy as np

from pagelm.errors import ModelFormatError
from pagelm.formats.safetensors import SafetensorsFile, ShardedSafetensors
from pagelm.quant import bf16_to_f32
from pagelm.quant.tiles import COLUMNS, ROWS, TILE_BYTES, TileKind, decode_groups, group_steps, kind_of_size
from pagelm.weights.hf import HFCheckpoint, HFConfig, HFLayout, plus_one

MODEL_FILE = "model.q4nx"
VERSION_KEY = "flm_version"
# Q8 codes are stored column-major per tile from this version on (before: in halves of 16 rows)
Q8_COLUMN_ORDER_SINCE = (1, 0, 3)
TIED_HEAD = "lm_head.weight"
EMBEDDINGS = "model.embed_tokens.weight"


def copy_name(name: str) -> str:
    """The name of the bf16 copy FastFlowLM may store beside tiled matrix `name`."""
    return re.sub(r"\.weight$", ".bf16.weight", name)


def is_flm_directory(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MODEL_FILE))


@dataclass(frozen=True)
class TiledMatrix:
    """A tiled matrix of `rows` × col_tiles·256 values in place: tiles (groups, col_tiles) from
    byte `offset` of `data` (the file map)."""

    name: str
    kind: TileKind
    groups: int
    col_tiles: int
    rows: int
    offset: int
    data: np.ndarray
    map: object

    @property
    def columns(self) -> int:
        return self.col_tiles * COLUMNS

    @property
    def nbytes(self) -> int:
        return self.groups * self.col_tiles * TILE_BYTES[self.kind]

    def raw(self) -> np.ndarray:
        return self.data[self.offset : self.offset + self.nbytes].reshape(self.groups, self.col_tiles, -1)

    def advise(self, advice: int) -> None:
        """madvise the matrix's pages. No-op without a map."""
        if self.map is not None:
            start = self.offset // mmap.PAGESIZE * mmap.PAGESIZE
            self.map.madvise(advice, start, self.offset + self.nbytes - start)

    def values(self) -> np.ndarray:
        """All rows as float32, decoded here (numpy)."""
        return decode_groups(self.raw(), self.kind)[: self.rows]


def _renamer(pairs: dict[str, str]):
    def rename(name: str) -> str:
        for old, new in pairs.items():
            if name.endswith("." + old):
                return name[: -len(old)] + new
        return name
    return rename


def flm_layout(module, config: HFConfig, names: set[str] | None) -> HFLayout:
    """The architecture's Hugging Face layout with FastFlowLM's names and conventions, for a
    file holding `names` (None: a directory about to be written)."""
    flm_names = getattr(module, "FLM_NAMES", {})
    to_flm, to_hf = _renamer(flm_names), _renamer({new: old for old, new in flm_names.items()})
    hf_names = None
    tied_head = config.get("tie_word_embeddings", False)
    if names is not None:
        hf_names = {to_hf(n) for n in names}
        tied_head = tied_head and TIED_HEAD in names and EMBEDDINGS not in names
        if tied_head:
            hf_names.add(EMBEDDINGS)
    layout = module.hf_layout(config, hf_names)
    maps = {}
    for name, tmap in layout.tensors.items():
        if tmap.to_gguf is plus_one:  # FastFlowLM folds the +1 into its norms, as GGUF does
            tmap = replace(tmap, to_gguf=None, to_hf=None)
        flm = TIED_HEAD if tied_head and tmap.hf == EMBEDDINGS else to_flm(tmap.hf)
        maps[name] = replace(tmap, hf=flm)
    flm_rows = getattr(module, "flm_rows", None)
    if flm_rows is not None:
        for name, rows in flm_rows(config).items():
            if name in maps:
                maps[name] = replace(maps[name], rows=rows)
    return HFLayout(layout.metadata, maps)


def parse_version(config: HFConfig) -> tuple[int, ...] | None:
    value = config.values.get(VERSION_KEY)
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"v?\d+(\.\d+){0,3}", value):
        raise ModelFormatError(f"{config.name}: {VERSION_KEY} is {str(value)[:40]!r}, expected a version like \"1.0.3\"")
    return tuple(int(p) for p in value.lstrip("v").split("."))


class FLMCheckpoint(HFCheckpoint):
    """A FastFlowLM model directory: plain tensors as in `HFCheckpoint`, tiled matrices in `tiles`
    (GGUF name → TiledMatrix), read in place by the tile kernels."""

    def __init__(self, path: str, config: HFConfig, shards: ShardedSafetensors, layout: HFLayout):
        held = shards.tensors
        tiled = {g: m for g, m in layout.tensors.items() if m.hf in held and held[m.hf].dtype == "I8"}
        super().__init__(path, config, shards, HFLayout(layout.metadata, {g: m for g, m in layout.tensors.items()
                                                                          if g not in tiled}))
        self.maps = layout.tensors
        version = parse_version(config)
        self.tiles = self._tiled(tiled, None if version is None else version < Q8_COLUMN_ORDER_SINCE)

    @staticmethod
    def _open_tensors(path: str) -> ShardedSafetensors:
        file = SafetensorsFile.open(os.path.join(path, MODEL_FILE))
        return ShardedSafetensors(file.name, {MODEL_FILE: file}, dict.fromkeys(file.tensors, MODEL_FILE))

    @staticmethod
    def _layout(module, config: HFConfig, names: set[str]) -> HFLayout:
        return flm_layout(module, config, names)

    def _tiled(self, tiled: dict, q8_v102: bool | None) -> dict[str, TiledMatrix]:
        """The tiled matrices, with the Q8 code order of the file's version (or, without one, the
        order its bf16 copies confirm); every copy is checked against its decoded tiles."""
        if q8_v102 is None:
            q8_v102 = self._q8_order_from_copies([m.hf for m in tiled.values()])
        tiles = {gguf: self._matrix(tmap.hf, q8_v102) for gguf, tmap in tiled.items()}
        for m in tiles.values():
            if copy_name(m.name) in self.shards.tensors and self.copy_mismatches(m):
                raise ModelFormatError(f"{self.shards.name}: tensor '{m.name}' decodes to values further from its "
                                       f"bf16 copy than the quantization step: the tiles are not laid out as "
                                       f"{VERSION_KEY} {self.config.values.get(VERSION_KEY, '(absent)')} says")
        return tiles

    def _q8_order_from_copies(self, names: list[str]) -> bool:
        """Whether the Q8 tiles hold their codes in the order before 1.0.3, told by the copies."""
        q8 = [n for n in names if self.shards.tensors[n].shape[-1] == TILE_BYTES[TileKind.Q8]]
        checkable = [n for n in q8 if copy_name(n) in self.shards.tensors]
        if not q8:
            return False
        for q8_v102 in (False, True):
            if checkable and not any(self.copy_mismatches(self._matrix(n, q8_v102)) for n in checkable):
                return q8_v102
        raise ModelFormatError(
            f"{self.path}: config.json has no {VERSION_KEY}, and no bf16 copy of a Q8 tensor agrees with either "
            f"Q8 code order (1.0.3's or the older one); add \"{VERSION_KEY}\" to config.json")

    def _matrix(self, name: str, q8_v102: bool) -> TiledMatrix:
        info = self.shards.tensors[name]
        where = f"{self.shards.name}: tensor '{name}'"
        kind = kind_of_size(info.shape[-1], q8_v102) if len(info.shape) == 3 else None
        if kind is None or 0 in info.shape:
            raise ModelFormatError(f"{where}: I8 {list(info.shape)}, expected tiles [rows/32, columns/256, tile bytes] "
                                   f"with tiles of {', '.join(f'{b} ({k.name})' for k, b in TILE_BYTES.items() if k != TileKind.Q8_V102)} bytes")
        groups, col_tiles = info.shape[0], info.shape[1]
        rows = groups * ROWS
        copy = self.shards.tensors.get(copy_name(name))
        if copy is not None:
            if copy.dtype != "BF16" or len(copy.shape) != 2 or copy.shape[1] != col_tiles * COLUMNS \
                    or not (groups - 1) * ROWS < copy.shape[0] <= rows:
                raise ModelFormatError(f"{self.shards.name}: tensor '{copy.name}' is {copy.dtype} {list(copy.shape)}, "
                                       f"expected the BF16 copy of {name}: [rows, {col_tiles * COLUMNS}] with rows in "
                                       f"{(groups - 1) * ROWS + 1}..{rows}")
            rows = copy.shape[0]
        shard = self.shards.shard_of(name)
        return TiledMatrix(name, kind, groups, col_tiles, rows, info.offset, shard.data, shard.mmap)

    def copy_mismatches(self, matrix: TiledMatrix) -> int:
        """How many decoded values lie further from the stored bf16 copy than half a quantization
        step (plus the copy's own bf16 rounding)."""
        copy = bf16_to_f32(np.asarray(self.shards.tensor(copy_name(matrix.name))))
        values = matrix.values()
        half_step = np.repeat(group_steps(matrix.raw(), matrix.kind)[: matrix.rows], 32, axis=1) / 2
        bound = half_step + np.abs(copy) * np.float32(2.0**-8) + np.float32(1e-30)
        return int(np.count_nonzero(~(np.abs(values - copy) <= bound)))
