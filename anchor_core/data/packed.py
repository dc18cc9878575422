"""The packed store on disk (shards of windows) and its deterministic, resumable, sharded loader.

Layout of a packed folder (written by `anchor pack`):
  pack.json                      seq_len, windows, shards, special ids, tokenizer identity, layout
  shard-00000.tokens.npy         uint32 [n, T]
  shard-00000.seg.npy            int32  [n, T]   (see anchor_core.data.packing)
  shard-00000.tag.npy            uint8  [n, T]
  store/                         the token store the windows were cut from
  stats.json, stats.md, doc_lengths.png

    data = PackedData.open("runs/pack")
    batch = data.batch([0, 5, 7], "anchor")                 # Batch of int32 [3, T]
    loader = Loader(data, batch_size=4, variant="anchor", seed=0, rank=0, world_size=2)
    batch = next(loader); state = loader.state_dict()     # JSON-able
    loader.load_state_dict(state)                          # continues exactly there
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anchor_core.data.batch import Batch, Variant, check_variant, make_batch
from anchor_core.errors import InputError, read_json_object

PACK_FORMAT = 1
SHARD_SLOTS = 1 << 26  # slots per shard file (256 MiB of tokens)


class ShardWriter:
    """Appends window blocks to `.npy` shard files of at most `shard_slots` slots each.

    The header (with the shard's final shape) is written first and the rows are appended with
    plain sequential writes, which is faster than filling a memmap.
    """

    KEYS = (("tokens", np.uint32), ("seg", np.int32), ("tag", np.uint8))

    def __init__(self, folder: Path, seq_len: int, num_windows: int, shard_slots: int = SHARD_SLOTS):
        self.folder, self.T = folder, seq_len
        self.per = max(1, shard_slots // seq_len)
        self.total = num_windows
        self.shards: list[dict[str, Any]] = []
        self.files: list[Any] | None = None
        self.room = 0
        self.written = 0

    def _open(self) -> None:
        n = min(self.per, self.total - self.written)
        name = f"shard-{len(self.shards):05d}"
        self.files = []
        for key, dt in self.KEYS:
            f = open(self.folder / f"{name}.{key}.npy", "wb")
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dt)), "fortran_order": False,
                      "shape": (n, self.T)}
            np.lib.format.write_array_header_1_0(f, header)
            self.files.append(f)
        self.shards.append({"name": name, "windows": n})
        self.room = n

    def write(self, tokens: np.ndarray, seg: np.ndarray, tag: np.ndarray) -> None:
        i = 0
        while i < tokens.shape[0]:
            if self.files is None or self.room == 0:
                self.close_shard()
                self._open()
            assert self.files is not None
            k = min(tokens.shape[0] - i, self.room)
            for f, src, (_, dt) in zip(self.files, (tokens, seg, tag), self.KEYS):
                f.write(np.ascontiguousarray(src[i:i + k], dtype=dt).data)
            self.room -= k
            self.written += k
            i += k

    def close_shard(self) -> None:
        if self.files is not None:
            if self.room:
                raise AssertionError(f"shard closed with {self.room} windows missing")
            for f in self.files:
                f.close()
            self.files = None


_SHARD_NAME = re.compile(r"shard-\d{5,}")


def is_pack_output(path: str | Path) -> bool:
    return (Path(path) / "pack.json").is_file()


def read_pack_json(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / "pack.json"
    if not path.is_file():
        raise InputError("not a packed data folder (no pack.json; make one with `anchor pack`)", path=folder)
    meta = read_json_object(path, name=folder)
    if meta.get("format") != PACK_FORMAT:
        raise InputError(f"packed data format {meta.get('format')!r} is not {PACK_FORMAT}", path=folder)
    return meta


def pack_store_path(folder: str | Path) -> Path:
    """The token store of a packed folder: pack.json's `store`, which must lie inside the folder."""
    folder = Path(folder)
    ref = read_pack_json(folder).get("store", "store")
    if not isinstance(ref, str) or not ref.strip():
        raise InputError(f"pack.json: `store` must be a folder name, got {ref!r}", path=folder)
    store = (folder / ref).resolve()
    if folder.resolve() not in store.parents:
        raise InputError(f"pack.json: the store {ref!r} is not a folder inside the packed folder "
                         "(re-pack from the corpus)", path=folder)
    if not (store / "store.json").is_file():
        raise InputError(f"pack.json: the store {ref!r} is not a token store", path=folder)
    return store


@dataclass
class PackedData:
    """Read-only windows of a packed folder (memory-mapped), or of in-memory arrays."""

    tokens: list[np.ndarray]  # per shard uint32 [n, T]
    seg: list[np.ndarray]
    tag: list[np.ndarray]
    meta: dict[str, Any]

    def __post_init__(self) -> None:
        sizes = np.array([t.shape[0] for t in self.tokens], dtype=np.int64)
        self._ends = np.cumsum(sizes)

    @property
    def num_windows(self) -> int:
        return int(self._ends[-1]) if self._ends.size else 0

    @property
    def seq_len(self) -> int:
        return int(self.meta["seq_len"])

    @classmethod
    def from_arrays(cls, tokens: np.ndarray, seg: np.ndarray, tag: np.ndarray, **meta: Any) -> "PackedData":
        return cls([tokens], [seg], [tag], {"seq_len": tokens.shape[1], **meta})

    @classmethod
    def open(cls, folder: str | Path) -> "PackedData":
        """Open and validate a packed folder: pack.json's shards are files inside it whose shapes and
        dtypes match pack.json; an InputError names the problem."""
        folder = Path(folder)
        meta = read_pack_json(folder)
        T = meta.get("seq_len")
        if isinstance(T, bool) or not isinstance(T, int) or T < 2:
            raise InputError(f"pack.json: `seq_len` must be an integer >= 2, got {T!r}", path=folder)
        shards = meta.get("shards")
        if not isinstance(shards, list) or not shards:
            raise InputError("pack.json: `shards` must be a non-empty list", path=folder)
        arrays: dict[str, list[np.ndarray]] = {"tokens": [], "seg": [], "tag": []}
        dtypes = dict(ShardWriter.KEYS)
        total = 0
        for i, shard in enumerate(shards):
            name = shard.get("name") if isinstance(shard, dict) else None
            n = shard.get("windows") if isinstance(shard, dict) else None
            if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name):
                raise InputError(f"pack.json: shard {i} has no valid name (shard-NNNNN), got {name!r}", path=folder)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise InputError(f"pack.json: shard {name} has no window count, got {n!r}", path=folder)
            for key in arrays:
                f = folder / f"{name}.{key}.npy"
                if not f.is_file() or folder.resolve() not in f.resolve().parents:
                    raise InputError(f"shard file {f.name} is missing or lies outside the folder", path=folder)
                try:
                    a = np.load(f, mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError, EOFError) as e:
                    raise InputError(f"unreadable shard: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                                     path=f) from None
                if a.shape != (n, T) or a.dtype != np.dtype(dtypes[key]):
                    raise InputError(f"shard holds {a.dtype} {a.shape}, pack.json implies "
                                     f"{np.dtype(dtypes[key])} {(n, T)}", path=f)
                arrays[key].append(a)
            total += n
        if meta.get("num_windows", total) != total:
            raise InputError(f"pack.json: num_windows {meta.get('num_windows')!r} != {total}, the shards' sum",
                             path=folder)
        return cls(arrays["tokens"], arrays["seg"], arrays["tag"], meta)

    def windows(self, indices: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(tokens, seg, tag)`, each [B, T], of the windows at `indices`."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_windows):
            raise IndexError(f"window index out of range [0, {self.num_windows})")
        shard = np.searchsorted(self._ends, idx, side="right")
        local = idx - np.concatenate([[0], self._ends])[shard]
        T = self.seq_len
        out = (np.empty((idx.size, T), np.uint32), np.empty((idx.size, T), np.int32), np.empty((idx.size, T), np.uint8))
        for s in np.unique(shard):
            rows = np.flatnonzero(shard == s)
            for dst, src in zip(out, (self.tokens[s], self.seg[s], self.tag[s])):
                dst[rows] = src[local[rows]]
        return out

    def batch(self, indices: np.ndarray | list[int], variant: Variant, *, mask_cross_doc_loss: bool = False) -> Batch:
        """The windows at `indices` as a Batch of int32 [B, T] arrays for `variant`."""
        tokens, seg, tag = self.windows(indices)
        return make_batch(tokens, seg, tag, variant, mask_cross_doc_loss=mask_cross_doc_loss)


def heldout_windows(num_windows: int, count: int, seed: int) -> np.ndarray:
    """The `count` windows held out of training (a seeded draw over all `num_windows`, so that every part of the
    corpus can be among them), sorted. int64 [count]."""
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.random.default_rng([int(seed), 0x48454C44]).permutation(num_windows)[:count])


class Loader:
    """Deterministic batches for data-parallel rank `rank` of `world_size`.

    Epoch `e` visits the windows in the order `permutation(seed, e)`; global step `s` takes the
    windows `order[s G:(s + 1) G]` with `G = batch_size * world_size`, and rank `r` its slice
    `[r B, (r + 1) B)`. An incomplete last global batch is dropped; epochs follow each other without
    end. `state_dict()` is a small JSON-able dict; `load_state_dict` continues exactly there, also
    with another world size as long as the windows consumed divide into its global batch.

    `held_out` windows (`heldout_windows(num_windows, held_out, seed)`) are never in a batch: the epochs
    permute the others (with none held out the order is the one above).
    """

    def __init__(self, data: PackedData, batch_size: int, variant: Variant, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, mask_cross_doc_loss: bool = False, shuffle: bool = True, held_out: int = 0):
        self.variant = check_variant(variant)
        if batch_size < 1:
            raise InputError(f"batch size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise InputError(f"rank {rank} is not in [0, world_size={world_size})")
        self.data, self.B, self.seed = data, int(batch_size), int(seed)
        self.rank, self.world = int(rank), int(world_size)
        self.mask_cross_doc_loss, self.shuffle = mask_cross_doc_loss, shuffle
        self.G = self.B * self.world
        if not 0 <= held_out < data.num_windows:
            raise InputError(f"{held_out} held-out windows of {data.num_windows}: hold out fewer")
        self.held_out = int(held_out)
        self.trained = (np.setdiff1d(np.arange(data.num_windows), heldout_windows(data.num_windows, held_out, seed))
                        if held_out else None)
        n = data.num_windows - self.held_out
        self.steps_per_epoch = n // self.G
        if self.steps_per_epoch == 0:
            raise InputError(f"{n} windows{' not held out' if held_out else ''} are fewer than one global batch "
                             f"({self.B} x {self.world} ranks); pack more data or lower the batch size")
        self.epoch, self.step = 0, 0
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            n = self.data.num_windows - self.held_out
            self._order = (np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle
                           else np.arange(n))
            if self.trained is not None:
                self._order = self.trained[self._order]
        return self._order

    def indices(self) -> np.ndarray:
        """The window indices of this rank's next batch (without advancing)."""
        start = self.step * self.G + self.rank * self.B
        return self._epoch_order()[start:start + self.B]

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> Batch:
        batch = self.data.batch(self.indices(), self.variant, mask_cross_doc_loss=self.mask_cross_doc_loss)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step, self._order = self.epoch + 1, 0, None
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.step * self.G,
                "num_windows": self.data.num_windows, "shuffle": self.shuffle, "held_out": self.held_out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = {"held_out": 0, **state}  # a state from before windows could be held out held none
        for key in ("seed", "num_windows", "shuffle", "held_out"):
            mine = getattr(self, key, None) if key != "num_windows" else self.data.num_windows
            if state.get(key) != mine:
                raise InputError(f"loader state does not match this data: {key} {state.get(key)!r} != {mine!r}")
        consumed = int(state["consumed"])
        if consumed % self.G:
            raise InputError(f"loader state at {consumed} windows is not a multiple of the global batch {self.G}")
        self.epoch, self.step, self._order = int(state["epoch"]), consumed // self.G, None
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
