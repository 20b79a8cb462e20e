"""The regeneration shard cache: the target's replies on disk, one file per finished batch.

A directory under ``cache_dir()/regenerated/`` is keyed by everything that decides a reply
except the data: the target (spec, tiny-target seed, a hash of its config), its dtype and
``regen_max_new_tokens``. Inside, a record is keyed by a hash of the rendered prompt token
ids, so anything that changes the prompt (the cut at ``regen_max_prompt_len``, a chat
template setting) changes the key by itself, and data sets that share prompts share replies.

Each finished batch is one file written to a temp name and renamed into place, so a reader
only ever sees whole batches: ``kill -9`` mid-regeneration loses at most the batch in flight,
and the next start regenerates only what no file holds. Writers never share a file (the name
carries host, pid and a sequence number), so ranks on one node may share the directory.

With ``train.feature_cache`` the batch's target features go beside it (``features-<key>/``,
same name, ``.pt``), written before the replies: whoever finds the replies finds them too.
Read back with torch's weights-only loader (nothing loaded from disk runs code).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import socket
import sys
from pathlib import Path

from ..preflight.inputs import arch_hash, inside, read_json

FORMAT = 2  # 1: one JSON file per (data set, settings), written only at the end
_TMP = ".tmp-"


def prompt_key(ids: list[int]) -> str:
    """A record's key: the prompt's token ids, hashed (128 bits; collisions are not a concern)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:32]


class RegenCache:
    def __init__(self, path: Path, features_tag: str | None = None):
        self.dir = Path(path)
        self.features_dir = self.dir / f"features-{features_tag}" if features_tag else None
        self._seq = itertools.count()
        self._stem = f"b-{socket.gethostname()}-{os.getpid()}"
        self.skipped_files = 0  # unreadable batch files (a non-atomic file system, a copy): their replies are redone
        self.dropped_entries = 0  # malformed or out-of-vocabulary entries: their replies are redone

    @classmethod
    def for_target(cls, root: Path, cfg, target, layer_ids=None) -> "RegenCache":
        # regen_max_prompt_len is not here: the cut is part of the prompt ids, hence of each record's key
        key = json.dumps(_target_key(cfg, target) | {"new": cfg.data.regen_max_new_tokens} | _engine_key(cfg),
                         sort_keys=True)
        tag = None
        if layer_ids:
            fkey = json.dumps({"layers": list(layer_ids),
                               "attn": getattr(target.config, "_attn_implementation", None)}, sort_keys=True)
            tag = hashlib.sha256(fkey.encode()).hexdigest()[:12]
        return cls(Path(root) / hashlib.sha256(key.encode()).hexdigest()[:24], tag)

    @classmethod
    def for_continuations(cls, root: Path, cfg, target, tokens: int) -> "RegenCache":
        """The held-out estimate's rows (run/acceptance_estimate.eval_prompt_rows): exactly
        ``tokens`` greedy tokens after each eval prompt, past an end-of-turn token too, so a
        cache of their own beside the replies' (keyed like theirs, by the target and the length)."""
        key = json.dumps(_target_key(cfg, target) | {"continuation": tokens}, sort_keys=True)
        return cls(Path(root) / hashlib.sha256(key.encode()).hexdigest()[:24])

    # -- reading -----------------------------------------------------------------------
    def _batch_files(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("b-*.json") if not p.name.startswith(_TMP))

    def load(self, wanted: set[str] | None = None, *, vocab_size: int | None = None,
             max_new_tokens: int | None = None) -> dict[str, list[int]]:
        """Reply token ids by prompt key, from every whole batch on disk (only ``wanted`` keys).

        A cache may have been copied from elsewhere, so nothing in it is trusted: a batch file
        that is not JSON, too large, nested too deeply or a link out of the cache dir is skipped;
        an entry whose key is not a prompt key, or whose reply is not a list of token ids in
        ``[0, vocab_size)`` of at most ``max_new_tokens``, is dropped (an id out of the
        vocabulary would pass here and kill training partway). Both are counted, said once,
        and their replies regenerated."""
        self._sweep_tmp()
        found: dict[str, list[int]] = {}
        self.dropped_entries = 0
        for p in self._batch_files():
            recs = self._read_batch(p)
            if recs is None:
                self.skipped_files += 1
                continue
            for k, ids in recs.items():
                if wanted is not None and k not in wanted:
                    continue
                if _valid_reply(k, ids, vocab_size, max_new_tokens):
                    found[k] = ids
                else:
                    self.dropped_entries += 1
        if self.skipped_files or self.dropped_entries:
            print(f"regeneration cache {self.dir}: {self.skipped_files} unreadable batch file(s) skipped, "
                  f"{self.dropped_entries} malformed or out-of-vocabulary cached replies dropped; they are regenerated",
                  file=sys.stderr)
        return found

    def _read_batch(self, p: Path) -> dict | None:
        try:
            p = inside(self.dir, p.name, f"regeneration cache {self.dir}", ValueError)
            recs = read_json(p, "regeneration cache", ValueError)
        except ValueError:
            return None
        return recs if isinstance(recs, dict) else None

    def load_features(self, wanted: set[str]) -> dict:
        """Features by prompt key for ``wanted`` keys, where a batch file kept them (else absent).
        Files that are links out of the cache dir, or hold anything but tensors by prompt key,
        are misses; the caller checks each tensor's shape against its sequence."""
        import torch

        got: dict = {}
        if self.features_dir is None or not self.features_dir.is_dir():
            return got
        for p in sorted(self.features_dir.glob("b-*.pt")):
            try:
                p = inside(self.features_dir, p.name, "feature cache", ValueError)
                feats = torch.load(p, weights_only=True)
            except Exception:  # a broken file costs only a target forward later: a miss
                continue
            if isinstance(feats, dict):
                got.update({k: v for k, v in feats.items() if k in wanted and isinstance(v, torch.Tensor)})
        return got

    # -- writing -----------------------------------------------------------------------
    def write_batch(self, replies: dict[str, list[int]], features: dict | None = None) -> Path:
        """One finished batch: features first, then the replies, each via temp + rename."""
        name = f"{self._stem}-{next(self._seq):06d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        if features and self.features_dir is not None:
            import torch

            self.features_dir.mkdir(exist_ok=True)
            fpath = self.features_dir / f"{name}.pt"
            tmp = fpath.with_name(_TMP + fpath.name)
            torch.save(features, tmp)
            os.replace(tmp, fpath)
        path = self.dir / f"{name}.json"
        tmp = path.with_name(_TMP + path.name)
        tmp.write_text(json.dumps(replies))
        os.replace(tmp, path)
        return path

    def _sweep_tmp(self) -> None:
        """Remove temp files a killed writer on this host left (its pid is gone); a live
        writer's (another rank on this node) stay."""
        host = socket.gethostname()
        for d in (self.dir, self.features_dir):
            if d is None or not d.is_dir():
                continue
            for p in d.glob(_TMP + "b-*"):
                parts = p.name[len(_TMP):].split("-")
                try:
                    if "-".join(parts[1:-2]) == host and not _alive(int(parts[-2])):
                        p.unlink(missing_ok=True)
                except (ValueError, IndexError):
                    continue


def _target_key(cfg, target) -> dict:
    """What decides a target's greedy tokens, apart from the prompt and their number: the target
    (spec, tiny-target seed, a hash of its config), its dtype, and this cache's format."""
    return {"target": cfg.model.target, "target_seed": cfg.model.target_seed, "arch": arch_hash(target.config),
            "dtype": str(getattr(target, "dtype", None)), "v": FORMAT}


def _engine_key(cfg) -> dict:
    """vLLM's replies (data.regen_engine: vllm) go to a cache of their own: a near-tie in the
    logits may tip a token either way, and a cache holds one engine's replies. HF's key is
    unchanged (caches written before the setting existed stay valid)."""
    engine = getattr(cfg.data, "regen_engine", "hf")
    return {} if engine == "hf" else {"engine": engine}


_KEY = re.compile(r"[0-9a-f]{32}")


def _valid_reply(key, ids, vocab_size: int | None, max_new_tokens: int | None) -> bool:
    """A cache entry as regeneration writes it: a prompt key, and a non-empty list of token ids
    inside the vocabulary, no longer than the replies of this cache's settings."""
    if not isinstance(key, str) or not _KEY.fullmatch(key) or not isinstance(ids, list) or not ids:
        return False
    if max_new_tokens is not None and len(ids) > max_new_tokens:
        return False
    hi = vocab_size if vocab_size is not None else float("inf")
    return all(type(t) is int and 0 <= t < hi for t in ids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
