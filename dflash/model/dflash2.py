"""DFlash2 (z-lab and Inco AI, Aug 2026): the DFlash drafter plus two parts, as vLLM 0.32
runs them (vllm/model_executor/models/qwen3_dflash2.py, v1/worker/gpu/spec_decode/dflash2/).

1. A grouped dynamic convolution across the block's slots wraps each sublayer:
   ``out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c]``, taps that would reach
   before slot 0 of the block read zero. ``delta`` is one projection of the sublayer's (normed)
   input, for both sides: side 0 convolves the sublayer's input, side 1 its output
   (``attention_conv`` around attention incl. o_proj, ``mlp_conv`` around the MLP). Group g(c)
   = c // conv_group_size. Identity at init (base tap 0 = 1, the rest and the projection 0),
   so a fresh DFlash2 is the DFlash it wraps.
2. A low-rank candidate selector: per slot l (1..B-1) the top-k tokens of the drafter's head,
   with unary scores u = softcap(output_multiplier * logit). An edge from predecessor token a
   to candidate b at slot l scores ``u_l(b) + <A[a] * P h_l, B[b]>`` (A, B: vocab x rank
   codebooks, P: hidden -> rank). Slot 1's predecessor is the anchor; a greedy walk from it
   takes the best-scoring candidate, slot by slot, and that chain is the draft.

Training adds the selector's loss: a k-way cross-entropy over each slot's top-k, the predecessor
teacher-forced to the true previous token, the true token put in place of the k-th candidate
when it is not among them (SpecForge's `dflash2_selector_loss_alpha`, speculators' DFlash2),
weighted like the main loss and scaled by `train.selector_loss_alpha`.

Names are vLLM's: a layer's ``attention_conv.base_kernel`` [2, taps, H] and
``attention_conv.kernel_projection.weight`` [2 * taps * H / group, H] (likewise ``mlp_conv``),
``candidate_selector.{predecessor_codebook, successor_codebook}`` [V, rank] and
``candidate_selector.hidden_projection.weight`` [rank, H]; the export carries them as they are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .drafter import DFlashDrafter, DrafterLayer, apply_rope, attend, compute_precision, leading_matches
from .losses import selector_loss


def _f32(x: torch.Tensor) -> torch.Tensor:
    """At least float32, as vLLM scores candidates (float64 stays float64: tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def check(cfg) -> str | None:
    """One line naming the first DFlash2 field that cannot make a drafter, or None."""
    if cfg.conv_kernel_size < 1 or cfg.conv_group_size < 1 or cfg.selector_rank < 1 or cfg.selector_top_k < 1:
        return ("DFlash2: conv_kernel_size, conv_group_size, selector_rank and selector_top_k must be >= 1 "
                f"(have {cfg.conv_kernel_size}, {cfg.conv_group_size}, {cfg.selector_rank}, {cfg.selector_top_k})")
    if cfg.hidden_size % cfg.conv_group_size:
        return f"DFlash2: conv_group_size={cfg.conv_group_size} must divide hidden_size={cfg.hidden_size}"
    if cfg.selector_top_k > cfg.vocab_size:
        return f"DFlash2: selector_top_k={cfg.selector_top_k} exceeds vocab_size={cfg.vocab_size}"
    if cfg.output_multiplier <= 0:
        return f"DFlash2: output_multiplier={cfg.output_multiplier}: expected > 0 (vLLM's top-k needs it)"
    if cfg.copy_head or cfg.draft_vocab_size:
        return ("DFlash2: no copy head and no draft vocabulary (vLLM's selector reads the full-vocabulary "
                "head's top-k and indexes its codebooks by target token id)")
    return None


class GroupedConv(nn.Module):
    """vLLM's DFlashGroupedConv over blocks of `block_size` slots (x: [B, Q, H], Q = n blocks)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        B, Q, H = x.shape
        Bk, T, G = self.block_size, self.taps, self.groups
        xb = x.view(B, Q // Bk, Bk, G, self.group_size)
        k = self.base_kernel[side].view(T, G, self.group_size) + delta.view(B, Q // Bk, Bk, T, G)[..., None]
        out = k[..., 0, :, :] * xb
        for t in range(1, min(T, Bk)):  # tap t reads slot i - t of the same block, zero before slot 0
            out = out + k[..., t, :, :] * F.pad(xb[:, :, :-t], (0, 0, 0, 0, t, 0))
        return out.reshape(B, Q, H).to(x.dtype)

    def prepare(self, x: torch.Tensor):
        """(side-0 convolution of x, the side-1 coefficients), both from one projection of x."""
        c = self.kernel_projection(x).view(*x.shape[:2], 2, self.taps, self.groups)
        return self._convolve(x, c[:, :, 0], 0), c[:, :, 1]

    def finish(self, x: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, coefficients, 1)


class DFlash2Layer(DrafterLayer):
    def __init__(self, cfg, window: int | None = None):
        super().__init__(cfg, window)  # a sliding layer's window lives in the masks, as in DFlash
        args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
        self.attention_conv = GroupedConv(*args)
        self.mlp_conv = GroupedConv(*args)

    def forward(self, h, ctx_kv, cos, sin, mask):
        """DrafterLayer.forward with each sublayer wrapped in its convolution."""
        B, Q, _ = h.shape
        x, coeff = self.attention_conv.prepare(self.input_layernorm(h))
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.hd)).transpose(1, 2), cos, sin)
        k, v = self.kv(x, cos, sin)
        k = torch.cat([ctx_kv[0], k], dim=2)
        v = torch.cat([ctx_kv[1], v], dim=2)
        attn = attend(q, k, v, mask, self.nh != self.nkv)
        attn = self.o_proj(attn.transpose(1, 2).reshape(B, Q, self.nh * self.hd))
        h = h + self.attention_conv.finish(attn, coeff)
        x, coeff = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), coeff)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank).normal_(std=0.02))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank).normal_(std=0.02))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def chain_scores(self, candidate_ids, unary, hidden, anchor_ids):
        """vLLM's edge scores [B, L, k (predecessor), k (candidate)]: candidate_ids / unary
        [B, L, k], hidden [B, L, H]; slot 0's predecessors are all the anchor [B]."""
        k = candidate_ids.shape[-1]
        pred_ids = torch.cat([anchor_ids[:, None, None].expand(-1, 1, k), candidate_ids[:, :-1]], dim=1)
        pred = self.predecessor_codebook[pred_ids] * self.hidden_projection(hidden)[:, :, None]
        succ = self.successor_codebook[candidate_ids]
        return _f32(unary)[:, :, None] + _f32(torch.einsum("blpr,blcr->blpc", pred, succ))

    def teacher_scores(self, candidate_ids, unary, hidden, pred_ids):
        """Edge scores from one given predecessor per slot: [..., k] (training)."""
        pred = self.predecessor_codebook[pred_ids] * self.hidden_projection(hidden)
        return _f32(unary) + _f32(torch.einsum("...r,...cr->...c", pred, self.successor_codebook[candidate_ids]))


def walk(candidate_ids: torch.Tensor, scores: torch.Tensor, pick=None) -> tuple[torch.Tensor, list]:
    """The selector's chain from the anchor (vLLM's _selector_walk_kernel): at slot l the row of
    the previous pick's scores, then `pick(row)` (argmax when None) -> (tokens [B, L], rows)."""
    B, L, k = candidate_ids.shape
    prev = torch.zeros(B, dtype=torch.long, device=candidate_ids.device)
    rows_b = torch.arange(B, device=candidate_ids.device)
    tokens, rows = [], []
    for l in range(L):
        row = scores[rows_b, l, prev]  # [B, k]
        idx = row.argmax(-1) if pick is None else pick(row, l)
        tokens.append(candidate_ids[rows_b, l, idx])
        rows.append(row)
        prev = idx
    return torch.stack(tokens, 1), rows


class DFlash2Drafter(DFlashDrafter):
    """What model/architectures.make_drafter builds for cfg.arch == "dflash2" (its config fields,
    bounds and served format: family/dflash2.py)."""

    def __init__(self, cfg):
        err = check(cfg)
        if err:
            from ..errors import ConfigError
            raise ConfigError(err)
        super().__init__(cfg)
        self.layers = nn.ModuleList(DFlash2Layer(cfg, cfg.layer_window(i)) for i in range(cfg.num_hidden_layers))
        self.layers.apply(self._init)
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)

    def blocks_hidden(self, block_emb, block_pos, ctx_kv, mask):
        scale = self.cfg.input_embedding_scale
        return super().blocks_hidden(block_emb * scale if scale != 1.0 else block_emb, block_pos, ctx_kv, mask)

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's candidate values: output_multiplier, then the soft cap (both monotonic)."""
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping or 0.0
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    # -- training -------------------------------------------------------------------------
    def train_forward(self, features, input_ids, anchors, anchor_valid, embed, lm_head, labels=None):
        """DFlashDrafter.train_forward's logits, output_multiplier and soft cap applied (the unary
        scores the selector ranks)."""
        if lm_head is None:
            raise ValueError("DFlash2 trains from the full logits (its selector reads each slot's top-k)")
        logits, _ = self.slot_outputs(features, input_ids, anchors, anchor_valid, embed, lm_head)
        return self.unary(logits)

    def train_terms(self, features, input_ids, anchors, anchor_valid, embed, lm_head, labels):
        """(train_forward's logits, the selector's per-slot k-way CE [B, A, Bk-1] on ``labels``), one pass."""
        logits, h = self.slot_outputs(features, input_ids, anchors, anchor_valid, embed, lm_head)
        logits = self.unary(logits)
        with compute_precision(embed.weight):
            return logits, self.selector_ce(logits, h, labels, input_ids, anchors, lm_head)

    def forward(self, features, slots, objective):
        """DFlash's per-slot loss on the unary logits plus the selector's term (model/losses.py
        `selector_loss`: its k-way CE weighted as the paper's loss, x train.selector_loss_alpha)."""
        logits, ce = self.train_terms(features, slots.ids, slots.anchors, slots.valid, objective.embed, slots.head,
                                      slots.labels)
        loss, acc = objective.slot_loss(logits, slots)
        sel = selector_loss(ce, objective.weights, slots.label_mask, slots.valid, objective.train.selector_loss_alpha)
        return loss + sel, acc, {"selector_loss": sel.detach()}

    def selector_ce(self, logits, h, labels, input_ids, anchors, lm_head):
        """Per-slot k-way CE of the selector [B, A, K], predecessors teacher-forced."""
        k = min(self.cfg.selector_top_k, logits.shape[-1])
        ids = getattr(lm_head, "ids", None)  # a loss-vocabulary head (RowsHead): logits over its rows
        cols = lm_head.to_subset(labels) if ids is not None else labels
        top_col = logits.detach().topk(k, dim=-1).indices
        cand = ids[top_col] if ids is not None else top_col
        # the true token replaces the k-th candidate where it is not among the top-k
        put = ~(cand == labels[..., None]).any(-1, keepdim=True) & (torch.arange(k, device=cand.device) == k - 1)
        cand = torch.where(put, labels[..., None], cand)
        top_col = torch.where(put, cols[..., None], top_col)
        unary = torch.gather(logits, -1, top_col)  # with gradient
        target = (cand == labels[..., None]).float().argmax(-1)
        anchor_tok = torch.gather(input_ids, 1, anchors)[..., None]
        pred_ids = torch.cat([anchor_tok, labels[..., :-1]], dim=-1)
        scores = self.candidate_selector.teacher_scores(cand, unary, h, pred_ids)
        return F.cross_entropy(scores.flatten(0, -2), target.flatten(), reduction="none").view_as(target)

    # -- inference ------------------------------------------------------------------------
    @torch.no_grad()
    def candidates(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head):
        """(candidate ids [B, L, k], unary scores [B, L, k], edge scores [B, L, k, k]) of one block."""
        Bk, dev = self.cfg.block_size, anchor_id.device
        ids = torch.full((anchor_id.shape[0], Bk), self.cfg.mask_token_id, device=dev, dtype=torch.long)
        ids[:, 0] = anchor_id
        pos = (anchor_pos + torch.arange(Bk, device=dev)).expand(ids.shape[0], Bk)
        ctx_kv, mask = self.windowed_context(ctx_kv, anchor_pos)  # sliding layers: their window
        with compute_precision(embed.weight):
            h = self.blocks_hidden(embed(ids), pos, ctx_kv, mask)[:, 1:]
            values, cand = lm_head(h).topk(self.cfg.selector_top_k, dim=-1)
            unary = self.unary(_f32(values))
            scores = self.candidate_selector.chain_scores(cand, unary, h, anchor_id)
        return cand, unary, scores

    @torch.no_grad()
    def chain_drafts(self, logits, hidden, anchor_ids):
        """The greedy chains of many blocks at once from their slot logits [..., L, V] and
        hidden [..., L, H] (slot_outputs), anchors [...]: [..., L] (the held-out estimate)."""
        lead = logits.shape[:-2]
        values, cand = logits.flatten(0, -3).topk(self.cfg.selector_top_k, dim=-1)
        scores = self.candidate_selector.chain_scores(cand, self.unary(_f32(values)), hidden.flatten(0, -3),
                                                      anchor_ids.flatten())
        return walk(cand, scores)[0].view(*lead, -1)

    def walk_accepted(self, logits, hidden, input_ids, anchors, labels, ok, lm_head):
        """The held-out walk's hook: the selector's greedy chains, as decoding drafts them."""
        drafts = self.chain_drafts(logits, hidden, torch.gather(input_ids, 1, anchors))
        return leading_matches(drafts, labels, ok)

    @torch.no_grad()
    def draft(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head, context_ids=None):
        cand, _, scores = self.candidates(anchor_id, anchor_pos, ctx_kv, embed, lm_head)
        return walk(cand, scores)[0]

    @torch.no_grad()
    def draft_logits(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head, context_ids=None):
        """The unary head's logits (output_multiplier and soft cap applied); drafts come from
        `draft` / `sample_chain`, which walk the selector."""
        with compute_precision(embed.weight):
            return self.unary(_f32(super().draft_logits(anchor_id, anchor_pos, ctx_kv, embed, lm_head)))

    @torch.no_grad()
    def sample_chain(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head, dist, generator):
        """Temperature > 0: walk by sampling each slot from `dist` (the sampling rule) of its
        realized score row, -inf off the k candidates (vLLM's draft logits), one sequence.
        Returns (tokens [L], q [L, V]: the distributions they were drawn from)."""
        cand, _, scores = self.candidates(anchor_id, anchor_pos, ctx_kv, embed, lm_head)
        V = lm_head.weight.shape[0]
        qs = []

        def pick(row, l):
            full = row.new_full((V,), float("-inf")).scatter_(0, cand[0, l], row[0])
            q = dist(full)
            qs.append(q)
            tok = torch.multinomial(q[None], 1, generator=generator)[0, 0].to(cand.device)  # sampling.draw
            return (cand[0, l] == tok).float().argmax()[None]

        tokens, _ = walk(cand, scores, pick)
        return tokens[0], torch.stack(qs)
