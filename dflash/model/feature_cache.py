"""`train.feature_cache`: every training sequence's target features kept after its first
forward (the target is frozen), so later epochs skip the target. For small data sets that
fit (the demo: ~120 sequences x 160 tokens x 3 layers, ~130 MB).

The run owns one cache per target replica (`replica(device)`): a hit must come back on
the replica's device, as a forward's output would.

When the loss reads the target's distribution (`train.loss` kl / lk, DSpark's L1 distance)
with `train.kl_topk` = k, the features end with the target's last hidden state (`FINAL`),
from which the drafter side would otherwise take the target's top-k at every scored slot of
every step: one [slots x vocabulary] product a step (a third of a DSpark step on the demo's
CPU). With ``head`` (the replica's lm_head) and ``topk`` the cache keeps, per sequence, the
top-k log-probs and ids at every position instead of the last hidden state, computed once
(a forward's batch at once; a preloaded sequence at its first hit), and hands them to the
drafter as a capture does (``batch.kl_topk``), so every step reads the same distribution
and none recomputes it. It is also smaller while k < H / 4: k x 8 bytes a token against H x 2
(bf16) or H x 4 (float32).
"""
from __future__ import annotations

import torch

from ..data.batch import Batch


class FeatureCache:
    def __init__(self, layer_ids, device="cpu", head: torch.nn.Module | None = None, topk: int = 0,
                 like: torch.Tensor | None = None):
        self.layer_ids = tuple(layer_ids)
        self.device = torch.device(device)
        self._rows: dict = {}  # key -> features [n, F], or (features without FINAL, log-probs, ids) with a top-k
        self.head, self.topk = (head, int(topk)) if head is not None and topk > 0 else (None, 0)
        # the head runs at the dtype and precision the drafter side would use: its embedding's
        # (objective.py), which is the head's own unless a target keeps the two in different dtypes
        self.like = like if like is not None or self.head is None else self.head.weight
        self._H = head.weight.shape[-1] if self.head is not None else 0  # FINAL's width: the last columns

    def __len__(self) -> int:
        return len(self._rows)

    def _key(self, ids: torch.Tensor) -> tuple:
        """One sequence's key: the layers and the int64 token ids."""
        return self.layer_ids, ids.to(torch.long).numpy().tobytes()

    def _top(self, final: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] last hidden states -> the target's top-k (log-probs float32, ids int32) [..., k],
        as the drafter side takes them (objective.py `slot_targets`: the head at the target's dtype,
        log-softmax in float32), ``chunk`` positions at a time: a batch's full rows (positions x
        vocabulary, 10 GB for 16K positions of a 152K vocabulary) are never all in memory."""
        from .drafter import compute_precision

        flat = final.reshape(-1, final.shape[-1]).to(self.like.dtype)
        k = min(self.topk, self.head.weight.shape[0])
        vals, ids = [], []
        with torch.no_grad(), compute_precision(self.like):
            for a in range(0, flat.shape[0], chunk):
                v, i = torch.log_softmax(self.head(flat[a:a + chunk]).float(), dim=-1).topk(k, dim=-1)
                vals.append(v)
                ids.append(i.to(torch.int32))
        shape = (*final.shape[:-1], k)
        return torch.cat(vals).view(shape), torch.cat(ids).view(shape)

    def _row(self, key):
        """A kept sequence, top-k'd at its first use (a preloaded one still holds FINAL)."""
        r = self._rows.get(key)
        if r is not None and self.topk and not isinstance(r, tuple):
            r = self._rows[key] = (r[:, :-self._H].clone(), *self._top(r[:, -self._H:]))
        return r

    def assemble(self, batch: Batch) -> torch.Tensor | None:
        """[B, S, F] from kept rows when every sequence of the batch is kept (padding rows
        zero, which is what pack/unpack hand the drafter anyway); else None. With a top-k the
        features lack FINAL and ``batch.kl_topk`` gets the distribution [B, S, k]."""
        rows = [self._row(self._key(batch.input_ids[i, :n])) for i, n in enumerate(batch.lengths)]
        if any(r is None for r in rows):
            return None
        parts = [[r] if not isinstance(r, tuple) else list(r) for r in rows]
        out = [p.new_zeros(len(rows), batch.padded_len, p.shape[-1]) for p in parts[0]]
        for i, ps in enumerate(parts):
            for o, p in zip(out, ps):
                o[i, :p.shape[0]] = p
        if self.topk:
            batch.kl_topk = (out[1], out[2])
        return out[0]

    def keep(self, batch: Batch, feats: torch.Tensor) -> torch.Tensor:
        """Keep a forward's rows; returns the features the drafter gets (with a top-k: without
        FINAL, and ``batch.kl_topk`` set, the whole batch's distribution in one product)."""
        if not self.topk:
            for i, n in enumerate(batch.lengths):
                self._rows.setdefault(self._key(batch.input_ids[i, :n]), feats[i, :n].clone())
            return feats
        out, (logp, ids) = feats[..., :-self._H], self._top(feats[..., -self._H:])
        for i, n in enumerate(batch.lengths):
            self._rows.setdefault(self._key(batch.input_ids[i, :n]),
                                  (out[i, :n].clone(), logp[i, :n].clone(), ids[i, :n].clone()))
        batch.kl_topk = (logp, ids)
        return out

    def preload(self, features: dict, max_len: int) -> int:
        """Seed with features regeneration kept (token-id tuple -> [len, n*H]), cut to
        `data.max_len` as the samples are. Returns how many went in."""
        for ids, rows in (features or {}).items():
            self._rows.setdefault(self._key(torch.tensor(ids[:max_len])), rows[:max_len].to(self.device))
        return len(features or {})

    def replica(self, device, head: torch.nn.Module | None = None, like: torch.Tensor | None = None) -> "FeatureCache":
        """The same rows on another device, for another target replica (``head``: its lm_head,
        ``like``: its input embedding)."""
        other = FeatureCache(self.layer_ids, device, head if self.topk else None, self.topk, like)
        other._rows = {k: (tuple(t.to(other.device) for t in v) if isinstance(v, tuple) else v.to(other.device))
                       for k, v in self._rows.items()}
        return other
