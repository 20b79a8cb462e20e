"""Feature shards on disk: written by `dflash capture` (ShardWriter), read by training
(FeatureStore). Format in feature_index.py.

Shards are safetensors: no pickle, and a reader maps them instead of loading them, so a
batch reads only its own rows (`get_slice`) and a capture far larger than memory trains.
Each shard is written to a temp name and renamed: a killed capture leaves whole shards,
each tagged with the id of the capture it belongs to (`capture_id`: target, layers, dtype,
data), which is what `dflash capture --resume` keeps and builds on (`shards_on_disk`).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..data.batch import Batch
from ..data.dataset import Sample
from ..preflight.checkpoint_files import plain_modes
from .feature_index import FORMAT, VERSION, shards_on_disk  # noqa: F401 (shards_on_disk: torch-free, there)

SHARD_BYTES = 512 * 2**20   # a shard's feature bytes before the next one starts


def sequence_key(ids) -> bytes:
    """One sequence's key: a hash of its int64 token ids (16 bytes, whatever its length)."""
    t = torch.as_tensor(ids, dtype=torch.long)
    return hashlib.blake2b(t.numpy().tobytes(), digest_size=16).digest()


def data_fingerprint(samples) -> str:
    """What the features were captured for: every sample's ids and loss mask, in order."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.ids.astype("<i8").tobytes())  # as int64, the bytes it always hashed
        h.update(s.mask.tobytes())
        h.update(b"|")
    return h.hexdigest()


def capture_id(key: dict) -> str:
    """A short id of a capture's key (target, seed, arch, layer ids, dtype, data fingerprint)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def index_entry(shard: dict) -> dict:
    """What the index keeps of a shard."""
    return {k: shard[k] for k in ("file", "samples", "tokens", "bytes")}


class ShardWriter:
    """One rank's shards: ``add`` each sample's rows, ``finish`` writes the rest and returns
    the shard list for the index. ``first``: the number of its first shard (after the
    shards a resumed capture keeps)."""

    def __init__(self, out: Path, rank: int, shard_bytes: int = SHARD_BYTES, *, capture: str = "", first: int = 0):
        self.out, self.rank, self.shard_bytes = Path(out), rank, shard_bytes
        self.capture, self.first = capture, first
        self.shards: list[dict] = []
        self._phase = None  # the run's "capture_shard" phase: from a shard's first sample to its file
        self._reset()

    def _reset(self):
        self._feats, self._ids, self._mask, self._pos, self._bytes = [], [], [], [], 0
        self._kl_logp, self._kl_ids = [], []

    def add(self, position: int, sample: Sample, feats: torch.Tensor, kl: tuple | None = None) -> None:
        """``feats``: [len, F] on the host, the sample's rows of a forward; ``kl``: the
        target's top-k next-token (log-probs [len, k] fp16, ids [len, k] int32), if kept."""
        n = len(sample)
        if feats.shape[0] != n:
            raise ValueError(f"sample {position}: {feats.shape[0]} feature rows for {n} tokens")
        if self._phase is None:
            from ..phases import phase
            self._phase = phase("capture_shard", shard=self.first + len(self.shards))
            self._phase.__enter__()
        if kl is not None:
            self._kl_logp.append(kl[0].contiguous())
            self._kl_ids.append(kl[1].contiguous())
            self._bytes += sum(t.numel() * t.element_size() for t in kl)
        self._feats.append(feats.contiguous())
        self._ids.append(torch.from_numpy(sample.ids.copy()))  # int32
        self._mask.append(torch.from_numpy(sample.mask.copy()))  # uint8
        self._pos.append(position)
        self._bytes += feats.numel() * feats.element_size()
        if self._bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pos:
            return
        lengths = torch.tensor([0] + [len(x) for x in self._ids], dtype=torch.long)
        tensors = {"features": torch.cat(self._feats), "input_ids": torch.cat(self._ids),
                   "loss_mask": torch.cat(self._mask), "offsets": torch.cumsum(lengths, 0),
                   "sample": torch.tensor(self._pos, dtype=torch.long)}
        if self._kl_logp:  # train.loss=kl: the target's top-k next-token distribution per token
            tensors |= {"kl_logp": torch.cat(self._kl_logp), "kl_ids": torch.cat(self._kl_ids)}
        name = f"shard-r{self.rank}-{self.first + len(self.shards):05d}.safetensors"
        tmp = self.out / f".{name}.tmp{os.getpid()}"
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "version": str(VERSION), "capture": self.capture})
        plain_modes(tmp)  # readable by every rank and user under the umask, like any data set
        os.replace(tmp, self.out / name)
        self.shards.append({"file": name, "samples": len(self._pos), "tokens": int(lengths.sum()),
                            "bytes": (self.out / name).stat().st_size})
        self._reset()
        if self._phase is not None:
            self._phase.set(**{k: v for k, v in self.shards[-1].items()})
            self._phase.__exit__(None, None, None)
            self._phase = None

    def finish(self) -> list[dict]:
        self._flush()
        return self.shards


class FeatureStore:
    """A finished capture, for training: its samples (in the prepared order) and, per batch,
    the captured features of the batch's sequences (`attach`, the `data_load` stage)."""

    def __init__(self, path: str, index: dict):
        self.path, self.index = Path(path), index
        self.layer_ids = list(index["key"]["layer_ids"])
        self._files = [self.path / s["file"] for s in index["shards"]]
        self._open: dict = {}
        self._where: dict = {}  # sequence key -> (shard, first row, rows)

    def _shard(self, k: int):
        f = self._open.get(k)
        if f is None:  # mapped, not read: a batch reads only its own rows
            f = self._open[k] = safe_open(str(self._files[k]), framework="pt")
        return f

    def samples(self) -> list[Sample]:
        """Every captured sample, in the order training would have prepared them."""
        by_pos: dict = {}
        for k in range(len(self._files)):
            f = self._shard(k)
            # each sample is a view of its shard's arrays: 5 bytes a token, no list per sample
            ids, mask = f.get_tensor("input_ids").numpy(), f.get_tensor("loss_mask").numpy()
            offsets, pos = f.get_tensor("offsets").tolist(), f.get_tensor("sample").tolist()
            for j, p in enumerate(pos):
                a, b = offsets[j], offsets[j + 1]
                s = Sample(ids[a:b], mask[a:b])
                by_pos[p] = s
                self._where.setdefault(sequence_key(s.ids), (k, a, b - a))
        if sorted(by_pos) != list(range(len(by_pos))) or len(by_pos) != self.index["samples"]:
            raise ValueError(f"features {self.path}: shards hold {len(by_pos)} samples, the index says "
                             f"{self.index['samples']}; capture again")
        return [by_pos[p] for p in range(len(by_pos))]

    def attach(self, batch: Batch) -> Batch:
        """Read the batch's rows into ``batch.features`` [B, S, F] (padding rows zero, as a
        forward's are after pack/unpack)."""
        if not self._where:
            self.samples()
        out = logp = ids = None
        kl = bool(self.index.get("kl_topk"))
        for i, n in enumerate(batch.lengths):
            where = self._where.get(sequence_key(batch.input_ids[i, :n]))
            if where is None:
                raise KeyError(f"features {self.path}: batch {batch.index} row {i} was not captured")
            k, a, rows = where
            x = self._shard(k).get_slice("features")[a:a + min(rows, n)]
            if out is None:
                out = x.new_zeros(len(batch.lengths), batch.padded_len, x.shape[-1])
            out[i, :x.shape[0]] = x
            if kl:  # padding rows: never read (no slot predicts from them)
                lp = self._shard(k).get_slice("kl_logp")[a:a + min(rows, n)]
                ti = self._shard(k).get_slice("kl_ids")[a:a + min(rows, n)]
                if logp is None:
                    logp = lp.new_zeros(len(batch.lengths), batch.padded_len, lp.shape[-1])
                    ids = ti.new_zeros(len(batch.lengths), batch.padded_len, ti.shape[-1])
                logp[i, :lp.shape[0]], ids[i, :ti.shape[0]] = lp, ti
        batch.features = out
        if kl:
            batch.kl_topk = (logp, ids)
        return batch
