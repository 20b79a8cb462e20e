"""DSpark (arXiv 2607.05147): the DFlash drafter plus a low-rank Markov head and an optional
confidence head, as vLLM 0.32 runs them (vllm/model_executor/models/qwen3_dspark.py,
v1/worker/gpu/spec_decode/dspark/speculator.py). Config fields, bounds, served format: family/dspark.py.

- The Markov head. A DFlash block's drafts are conditionally independent: every slot reads the
  context and the anchor, none reads the draft before it. DSpark adds to slot k's logits a bias
  from the token before it: ``bias = markov_w2 @ markov_w1[prev]`` (markov_w1: a V x r embedding,
  markov_w2: r -> V), prev = the anchor for slot 1, else the draft of slot k - 1. Drafting is
  then left to right inside the block, one cheap [r x V] product per slot after the backbone's
  one parallel pass (vLLM's `_sample_sequential`; greedy: each slot's argmax). markov_w2 starts
  at zero, so a fresh DSpark drafts what the DFlash it wraps drafts.
- The confidence head (``cfg.confidence_head``): per slot, ``sigmoid(proj([h_k, markov_w1[prev]]))``
  (h_k the slot's final hidden state; without the Markov embedding when
  ``confidence_with_markov`` is off), the probability that slot k's draft is accepted given
  that the slots before it were. Our decoder can stop drafting where the product of those
  falls below ``eval.confidence_threshold`` (`draft`'s ``threshold``): a shorter block to verify.

With a draft vocabulary (``cfg.draft_vocab_size``, `model.draft_vocab`: drafts come from the
most frequent training tokens only, as DFlash's do) the Markov head is vLLM's reduced-vocabulary
one: ``markov_w1`` still embeds any target token (the anchor, or a draft mapped back to its
target id), ``markov_w2`` has one row per draft token (weight [V', r]), and the bias is added
to the draft head's logits; the export carries that head and `d2t` as a DFlash export does, and
vLLM's `Qwen3DSparkForCausalLM` maps each sampled draft id to its target id before it embeds it.

Training is teacher-forced (NeMo's and speculators' training forward): prev is the true previous
token, so the whole block's logits come from one pass. The walk of the held-out estimate
(run/acceptance_estimate.py) reads those same teacher-forced logits, and that is exact: a verify
step accepts the leading slots whose draft equals the target's token, and up to the first that
does not, every draft before a slot was the true token, so its bias was the teacher-forced one.

The loss (`forward`; docs/losses.md "DSpark"): per slot, ce_alpha x CE on the target's token +
tv_alpha x the L1 distance between the drafter's and the target's distributions (both on the
Markov-biased logits), weighted as `train.loss_weights` says (D-PACE or the decay), and, with a
confidence head, confidence_alpha x its BCE against the analytical acceptance sum_v min(p_v, q_v)
= 1 - L1/2 (detached), decay-weighted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .drafter import DFlashDrafter, DraftVocabHead, compute_precision, leading_matches
from .losses import SlotTerms, l1_per_slot, reduce_terms


class MarkovHead(nn.Module):
    """vLLM's DSparkMarkovHead: ``markov_w1`` embeds the previous token (target vocabulary V x r),
    ``markov_w2`` (weight [V', r]: the draft vocabulary's rows, V' = V without one) projects that
    embedding to a bias over the drafts' vocabulary."""

    def __init__(self, vocab_size: int, rank: int, draft_vocab_size: int = 0):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size or vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # a fresh DSpark is the DFlash it wraps

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(token_ids)


class ConfidenceHead(nn.Module):
    """vLLM's DSparkConfidenceHead: one float32 linear map (with a bias) of the slot's hidden state,
    and the previous token's Markov embedding when ``with_markov``, to an acceptance logit."""

    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


def previous_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token before each scored slot [B, A, Bk-1], teacher-forced: the anchor, then the labels."""
    return torch.cat([torch.gather(input_ids, 1, anchors)[..., None], labels[..., :-1]], dim=-1)


class DSparkDrafter(DFlashDrafter):
    """What model/architectures.make_drafter builds for cfg.arch == "dspark"."""

    def __init__(self, cfg):
        if cfg.copy_head:
            from ..errors import ConfigError
            raise ConfigError("DSpark: no copy head (no engine drafts a DSpark block with one)")
        super().__init__(cfg)
        # after the backbone: the DFlash weights are drawn as for a DFlash drafter of the same seed
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.draft_vocab_size)
        self.confidence_head = None
        if cfg.confidence_head:
            with_markov = bool(cfg.confidence_with_markov)
            self.confidence_head = ConfidenceHead(cfg.hidden_size + (cfg.markov_rank if with_markov else 0),
                                                  with_markov)

    @torch.no_grad()
    def move_draft_rows(self, ids: torch.Tensor) -> None:
        """markov_w2's rows follow their tokens to the draft vocabulary ``ids`` (sorted target ids):
        a drafter from --init-from keeps what it learned for the tokens both vocabularies hold, and a
        token new to it starts at zero, as in a fresh DSpark. Without this, row i's bias would move to
        whichever token is i-th in the new vocabulary."""
        if not self.cfg.draft_vocab_size:
            return
        old, new = self.draft_ids, ids.to(self.draft_ids.device)
        at = torch.searchsorted(old, new).clamp_max(old.numel() - 1)
        w2 = self.markov_head.markov_w2.weight
        w2.copy_(w2.index_select(0, at) * (old.index_select(0, at) == new)[:, None].to(w2.dtype))

    # -- the Markov bias, teacher-forced (training, the walk) --------------------------------------
    def markov_bias(self, markov_embed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[..., r] -> the bias on every target token's column [..., V], or with ``rows`` (a loss
        vocabulary's sorted target ids) on those columns only. With a draft vocabulary, tokens
        outside it get no bias: they are never drafted (their served logits are -inf)."""
        w2 = self.markov_head.markov_w2.weight
        if not self.cfg.draft_vocab_size:
            return F.linear(markov_embed, w2 if rows is None else w2.index_select(0, rows))
        ids = self.draft_ids  # sorted target ids of the draft rows (set_draft_vocab)
        if rows is None:
            sub = F.linear(markov_embed, w2)
            full = sub.new_zeros(*sub.shape[:-1], self.cfg.vocab_size)
            return full.scatter_(-1, ids.expand(*sub.shape[:-1], -1), sub)
        at = torch.searchsorted(ids, rows).clamp_max(ids.numel() - 1)  # each column's draft row, if it has one
        w = w2.index_select(0, at) * (ids.index_select(0, at) == rows)[:, None].to(w2.dtype)
        return F.linear(markov_embed, w)

    def markov(self, logits, prev_ids, head):
        """(logits + the Markov bias of ``prev_ids`` [...] on ``head``'s columns, the Markov embedding):
        a loss vocabulary's columns (``head.ids``), else every target token's."""
        e = self.markov_head.embed(prev_ids)
        rows = None if isinstance(head, DraftVocabHead) else getattr(head, "ids", None)
        return logits + self.markov_bias(e, rows).to(logits.dtype), e

    def train_terms(self, features, input_ids, anchors, anchor_valid, embed, lm_head, labels):
        """One pass: (the slots' teacher-forced logits [B, A, Bk-1, V'], the confidence head's logits
        [B, A, Bk-1] or None)."""
        logits, h = self.slot_outputs(features, input_ids, anchors, anchor_valid, embed, lm_head)
        with compute_precision(embed.weight):
            logits, e = self.markov(logits, previous_tokens(input_ids, anchors, labels), lm_head)
            conf = self.confidence_head(h, e) if self.confidence_head is not None else None
        return logits, conf

    def train_forward(self, features, input_ids, anchors, anchor_valid, embed, lm_head, labels=None):
        """The slots' logits with the Markov bias of the true previous tokens (``labels`` required)."""
        if lm_head is None or labels is None:
            raise ValueError("DSpark trains from the full logits and the labels (its Markov head reads both)")
        return self.train_terms(features, input_ids, anchors, anchor_valid, embed, lm_head, labels)[0]

    def forward(self, features, slots, objective):
        """DSpark's loss (the module docstring): (loss, accuracy, {ce, l1, confidence_bce,
        confidence_error}) device scalars."""
        t = objective.train
        logits, conf = self.train_terms(features, slots.ids, slots.anchors, slots.valid, objective.embed, slots.head,
                                        slots.labels)
        lsm = F.log_softmax(logits.float(), dim=-1)
        label_logq = torch.gather(lsm, -1, slots.cols[..., None]).squeeze(-1)
        l1, accept = l1_per_slot(logits, slots.targets)
        per = t.dspark_ce_alpha * -label_logq + t.dspark_tv_alpha * l1
        terms = SlotTerms(per, label_logq.detach(), logits.argmax(-1) == slots.cols)
        loss, acc = reduce_terms(terms, slots.valid, slots.label_mask, objective.weights,
                                 weighting=t.loss_weights, dpace_alpha=t.dpace_alpha)
        w = objective.weights[None, None, :] * slots.label_mask * slots.valid[..., None]
        norm = w.sum().clamp_min(1e-6)
        metrics = {"ce": ((w * -label_logq).sum() / norm).detach(), "l1": ((w * l1).sum() / norm).detach(),
                   "acceptance": ((w * accept).sum() / norm).detach()}
        if conf is not None:
            target = accept.detach()
            bce = F.binary_cross_entropy_with_logits(conf, target, reduction="none")
            conf_loss = (w * bce).sum() / norm
            loss = loss + t.dspark_confidence_alpha * conf_loss
            metrics |= {"confidence_bce": conf_loss.detach(),
                        "confidence_error": ((w * (torch.sigmoid(conf) - target).abs()).sum() / norm).detach()}
        return loss, acc, metrics

    # -- what the held-out walk reads -------------------------------------------------------------
    def walk_accepted(self, logits, hidden, input_ids, anchors, labels, ok, lm_head):
        """The held-out walk's hook: each slot's argmax with the teacher-forced Markov bias, which is
        the decoder's greedy chain up to its first rejected slot (module docstring)."""
        with compute_precision(lm_head.weight):
            logits = self.markov(logits, previous_tokens(input_ids, anchors, labels), lm_head)[0]
        return leading_matches(logits.argmax(-1), labels, ok)

    def confidence(self, hidden, prev_ids):
        """The confidence head's per-slot acceptance estimate (a probability); None without one."""
        if self.confidence_head is None:
            return None
        return torch.sigmoid(self.confidence_head(hidden, self.markov_head.embed(prev_ids)))

    # -- inference: the block's drafts, left to right ------------------------------------------------
    @torch.no_grad()
    def slot_logits_and_hidden(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head):
        """The backbone's one parallel pass over a block: (base logits [B, Bk-1, V], hidden [B, Bk-1, H])."""
        Bk, dev = self.cfg.block_size, anchor_id.device
        ids = torch.full((anchor_id.shape[0], Bk), self.cfg.mask_token_id, device=dev, dtype=torch.long)
        ids[:, 0] = anchor_id
        pos = (anchor_pos + torch.arange(Bk, device=dev)).expand(ids.shape[0], Bk)
        ctx_kv, mask = self.windowed_context(ctx_kv, anchor_pos)
        with compute_precision(embed.weight):
            h = self.blocks_hidden(embed(ids), pos, ctx_kv, mask)[:, 1:]
            return self.serving_head(lm_head)(h), h

    @torch.no_grad()
    def chain(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head, pick=None, threshold: float = 0.0):
        """vLLM's sequential Markov drafting of one block: slot k's logits = base_k + the bias of the
        token picked at slot k - 1 (the anchor for slot 1), then ``pick(logits [B, V], k)`` (argmax
        when None). With a confidence head and ``threshold`` > 0, drafting stops before the first
        slot k whose estimate that slots 1..k are all accepted (the product of the head's per-slot
        estimates) is below it. Returns (tokens [B, n], the slots' logits [B, n, V], n <= Bk - 1)."""
        base, h = self.slot_logits_and_hidden(anchor_id, anchor_pos, ctx_kv, embed, lm_head)
        prev, toks, rows = anchor_id, [], []
        expect = torch.ones(anchor_id.shape[0], device=anchor_id.device)
        with compute_precision(embed.weight):
            for k in range(base.shape[1]):
                e = self.markov_head.embed(prev)
                if threshold > 0 and self.confidence_head is not None:
                    expect = expect * torch.sigmoid(self.confidence_head(h[:, k], e))
                    if bool((expect < threshold).all()):  # the host decides the block's length (one sequence)
                        break
                row = base[:, k] + self.markov_bias(e).to(base.dtype)
                tok = row.argmax(-1) if pick is None else pick(row, k)
                toks.append(tok)
                rows.append(row)
                prev = tok
        if not toks:
            empty = torch.zeros(anchor_id.shape[0], 0, dtype=torch.long, device=anchor_id.device)
            return empty, base[:, :0]
        return torch.stack(toks, 1), torch.stack(rows, 1)

    @torch.no_grad()
    def draft(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head, context_ids=None, threshold: float = 0.0):
        return self.chain(anchor_id, anchor_pos, ctx_kv, embed, lm_head, threshold=threshold)[0]

    @torch.no_grad()
    def draft_logits(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head, context_ids=None):
        """The greedy chain's logits [B, Bk-1, V]: each slot's with the bias of the draft before it."""
        return self.chain(anchor_id, anchor_pos, ctx_kv, embed, lm_head)[1]

    @torch.no_grad()
    def sample_chain(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head, dist, generator, threshold: float = 0.0):
        """Temperature > 0: each slot drawn from ``dist`` (the sampling rule) of its logits, whose bias
        is the token drawn before it: one sequence. Returns (tokens [n], q [n, V]: the distributions
        they were drawn from, which the speculative-sampling rule needs to stay lossless)."""
        qs = []

        def pick(row, k):
            q = dist(row[0])
            qs.append(q)
            return torch.multinomial(q[None], 1, generator=generator)[0].to(row.device)  # sampling.draw

        tokens, _ = self.chain(anchor_id, anchor_pos, ctx_kv, embed, lm_head, pick=pick, threshold=threshold)
        q = torch.stack(qs) if qs else torch.zeros(0, lm_head.weight.shape[0])
        return tokens[0], q
