"""The DFlash drafter: a few Qwen3-style layers that denoise a block of MASK tokens.

Facts this file is built to (see docs/design.md, "The DFlash drafter"):
- no embedding / lm_head of its own: the target's frozen ones are passed in;
- the selected target layers are fused (Linear n*H -> H, RMSNorm) into a *context*
  that enters every layer only as extra keys/values (same k_proj / v_proj / k_norm as
  the block tokens), never through the residual stream;
- a block is [anchor, MASK x (B-1)], bidirectional inside the block; a block sees
  context positions strictly before its anchor and nothing of other blocks;
- a sliding-window layer (`layer_types`, `sliding_window` W) narrows that per query
  position t as vLLM applies it: key position j is seen only when |t - j| <= W - 1 (so
  slot k of a block at p sees context p+k-W+1 .. p-1), still non-causal in the block.

One forward serves both training (many blocks per sequence, one pass, block mask) and
inference (one block, context keys/values from a cache).

Precision: the drafter's own weights (and so AdamW's master copy and moments) are always
float32; it *computes* in the dtype of the target's frozen embedding / lm_head, which is
the target's dtype (bf16 by default on CUDA). `compute_precision` is that rule, used by
training and inference alike, so eval runs in exactly the precision training did.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import family
from .copy_head import CopyHead


SLIDING, FULL = "sliding_attention", "full_attention"
COMPILE_BACKEND = "inductor"  # `train.compile`'s; the CPU twin test traces with "aot_eager" (no C++ build)


@dataclass
class _Drafter:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_hidden_layers: int = 1
    block_size: int = family.BLOCK_SIZE
    copy_head: bool = False          # mix in copies from the context, weight learned (copy_head.py)
    draft_vocab_size: int = 0        # > 0: drafts come from these tokens only, through a head of their rows
                                     # (draft_head, draft_ids): what an engine reads per step shrinks with it
    layer_types: list[str] = field(default_factory=list)  # per layer "sliding_attention" | "full_attention";
                                     # empty: all full (the exported config's own names)
    sliding_window: int = 0          # W of the sliding layers: a query at t sees keys j with |t - j| < W
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target: str = ""
    architectures: list[str] = field(default_factory=lambda: ["DFlashDrafter"])
    model_type: str = "dflash_drafter"
    # model.arch: the drafter family (dflash/family/); its own parts' fields are inherited below, and
    # model/architectures.py builds the drafter cfg.arch names
    arch: str = family.DEFAULT


@dataclass
class DrafterConfig(*reversed(family.MODEL_FIELDS), _Drafter):
    """A drafter's shape: the backbone's fields, then each family's own (dflash/family/), of which
    its config.json keeps its own family's only."""

    def to_dict(self) -> dict:
        d = asdict(self)
        own = family.of(self)
        for f in family.FAMILIES.values():
            if f is not own:
                for k in f.model_names:
                    del d[k]
        if own.name == family.DEFAULT:  # a DFlash drafter's config.json stays what it was
            del d["arch"]
        return d

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window W, or None for a full-attention layer."""
        sliding = self.layer_types and self.layer_types[i] == SLIDING
        return int(self.sliding_window) if sliding else None

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_target(cls, tcfg, *, target_layer_ids, mask_token_id, vocab_size, **kw) -> "DrafterConfig":
        """Mirror the target's attention geometry (hidden, heads, KV heads, head dim)."""
        tcfg = getattr(tcfg, "text_config", None) or tcfg
        heads = tcfg.num_attention_heads
        head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads
        rope = getattr(tcfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(tcfg, "rope_theta", None) or 10000.0
        return cls(
            hidden_size=tcfg.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=tcfg.intermediate_size,
            vocab_size=vocab_size,
            target_layer_ids=list(target_layer_ids),
            mask_token_id=mask_token_id,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            **kw,
        )


def compute_precision(frozen: torch.Tensor):
    """Autocast to the dtype of the target's frozen embedding / lm_head weight `frozen`.

    Master weights stay float32 (the optimizer updates them in full precision); matmuls,
    attention and the shared lm_head run in bf16 when the target is bf16. A float32 target
    means no autocast at all, so CPU float32 runs are bit-for-bit what they were."""
    if frozen.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=frozen.device.type, dtype=frozen.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise and scale in fp32, hand back the input's dtype: with fp32 weights and bf16
        # activations the result stays bf16 (a bare `weight * x` would promote to fp32)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv  # [..., S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x: [B, heads, S, D]; cos/sin: [B, S, D]."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(q, k, v, mask, gqa: bool):
    """Attention of the block queries over context + block keys: SDPA with a bool mask (or
    None: all visible), or flex_attention with a BlockMask (`train.attention=flex`,
    `flex_block_mask`), which skips the tiles the mask leaves empty."""
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return _flex()(q, k, v, block_mask=mask, enable_gqa=gqa)


_FLEX = {}


def _flex():
    """flex_attention, compiled on CUDA (unfused and slow without it; the compile is cached
    per process), eager elsewhere (the CPU twin: the same numbers, no speed asked of it)."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _FLEX["fn"]


def flex_block_mask(anchors, anchor_valid, S: int, Bk: int, window: int | None = None):
    """`DFlashDrafter.block_mask` as a flex_attention BlockMask: block j's queries see context
    positions < p_j (none for an invalid anchor) and their own block; a sliding layer's window
    W besides keeps |t - j| <= W - 1. Built without the dense [A*Bk, S + A*Bk] mask on CUDA
    (compiled): only the tiles any query sees are computed."""
    from torch.nn.attention.flex_attention import create_block_mask

    Bsz, A = anchors.shape
    Q = A * Bk
    limit = torch.where(anchor_valid, anchors, torch.zeros_like(anchors))  # context < limit
    qpos = (anchors[..., None] + torch.arange(Bk, device=anchors.device)).reshape(Bsz, Q)

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // Bk
        in_ctx = kv_idx < S
        ok = torch.where(in_ctx, kv_idx < limit[b, blk], (kv_idx - S) // Bk == blk)
        if window:
            dist = torch.where(in_ctx, qpos[b, q_idx] - kv_idx, (q_idx % Bk - (kv_idx - S) % Bk).abs())
            ok = ok & (dist < window)
        return ok

    return create_block_mask(mask_mod, Bsz, None, Q, S + Q, device=anchors.device,
                             _compile=anchors.device.type == "cuda")


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, window: int | None = None):
        super().__init__()
        self.window = window  # sliding window W, or None: full attention (the masks carry it)
        H, D = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.nh * D, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.o_proj = nn.Linear(self.nh * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)

    def kv(self, x, cos, sin):
        """Keys/values of x ([B, S, H]) at the rotary positions given; used for context and block."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, h, ctx_kv, cos, sin, mask):
        """h: block tokens [B, Q, H]; ctx_kv: (k, v) of the context [B, nkv, C, D];
        mask: bool [B, 1, Q, C+Q] (True = may attend), or None for 'see everything'."""
        B, Q, _ = h.shape
        x = self.input_layernorm(h)
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.hd)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        k = torch.cat([ctx_kv[0], k], dim=2)
        v = torch.cat([ctx_kv[1], v], dim=2)
        attn = attend(q, k, v, mask, self.nh != self.nkv)
        h = h + self.o_proj(attn.transpose(1, 2).reshape(B, Q, self.nh * self.hd))
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        n = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, cfg.layer_window(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.apply(self._init)
        # after the init above (which would redraw its zeroed gate) and after every other
        # module, so the rest starts from the same weights with or without it
        self.copy = CopyHead(cfg.block_size - 1, cfg.hidden_size) if cfg.copy_head else None
        self.use_copy = True  # False: the same drafter without its copy proposals (an ablation)
        self.attention = "sdpa"  # training's block attention: sdpa | flex (`train.attention`; set by the loss)
        if cfg.draft_vocab_size:  # frozen: the target's lm_head rows of draft_ids (set_draft_vocab)
            self.register_buffer("draft_head", torch.zeros(cfg.draft_vocab_size, cfg.hidden_size))
            self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size))

    @torch.no_grad()
    def set_draft_vocab(self, ids: torch.Tensor, lm_head: nn.Module) -> None:
        """Draft from the tokens `ids` (sorted target ids) only: their lm_head rows become
        the drafter's own head, as an engine stores it (`lm_head.weight` + `d2t` in the export)."""
        self.draft_ids.copy_(ids.to(self.draft_ids.device))
        self.draft_head.copy_(lm_head.weight.index_select(0, ids.to(lm_head.weight.device)).to(self.draft_head))

    def move_draft_rows(self, ids: torch.Tensor) -> None:
        """Before `set_draft_vocab(ids)` on a drafter that learned rows per draft token (DSpark's
        Markov head): move them to the new ids. DFlash's draft rows are the target's: nothing."""

    def serving_head(self, lm_head: nn.Module) -> nn.Module:
        """The head drafts are read through: the target's lm_head, or with a draft vocabulary
        its rows of draft_ids (logits elsewhere -inf, full width: argmax and sampling as before)."""
        return DraftVocabHead(self.draft_head, self.draft_ids, lm_head.weight.shape[0]) \
            if self.cfg.draft_vocab_size else lm_head

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def compile_layers(self, backend: str | None = None) -> None:
        """`train.compile`: each decoder layer through torch.compile, in place (Module.compile:
        the state dict's names are unchanged, so checkpoints and exports never see it)."""
        for layer in self.layers:
            layer.compile(backend=backend or COMPILE_BACKEND)

    # -- building blocks shared by training and inference ------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Selected target layers [B, S, n*H] -> context [B, S, H]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """Per-layer context keys/values; depends only on ctx and positions, hence cacheable."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, ctx.dtype)
        return [layer.kv(ctx, cos, sin) for layer in self.layers]

    def blocks_hidden(self, block_emb, block_pos, ctx_kv, mask):
        """block_emb [B, Q, H] at block_pos [B, Q] -> final-normed hidden [B, Q, H].
        ``mask``: one for every layer, or a list of one per layer (sliding windows)."""
        cos, sin = rope_cos_sin(block_pos, self.cfg.head_dim, self.cfg.rope_theta, block_emb.dtype)
        masks = mask if isinstance(mask, list) else [mask] * len(self.layers)
        h = block_emb
        for layer, kv, m in zip(self.layers, ctx_kv, masks):
            h = layer(h, kv, cos, sin, m)
        return self.norm(h)

    def layer_masks(self, make) -> list:
        """One mask per layer from ``make(window)`` (window None: full attention), each
        distinct window built once."""
        built = {}
        for layer in self.layers:
            if layer.window not in built:
                built[layer.window] = make(layer.window)
        return [built[layer.window] for layer in self.layers]

    def windowed_context(self, ctx_kv, anchor_pos: int):
        """Inference: (ctx_kv, mask) for one block at anchor_pos whose context cache holds the
        positions just before it. Without sliding layers: unchanged, mask None (all visible).
        A sliding layer keeps only its last W-1 context positions (the most any slot sees)
        and gets a mask [1, 1, Bk, kept + Bk] of |t - j| <= W - 1, as in training."""
        if not any(layer.window for layer in self.layers):
            return ctx_kv, None
        Bk, kv_out, masks = self.cfg.block_size, [], []
        for layer, (k, v) in zip(self.layers, ctx_kv):
            W = layer.window
            if W is None:
                kv_out.append((k, v))
                masks.append(None)
                continue
            keep = min(k.shape[2], W - 1)
            k, v = k[:, :, k.shape[2] - keep:], v[:, :, v.shape[2] - keep:]
            q = anchor_pos + torch.arange(Bk, device=k.device)
            keys = torch.cat([anchor_pos - keep + torch.arange(keep, device=k.device), q])
            kv_out.append((k, v))
            masks.append(((q[:, None] - keys[None, :]).abs() < W)[None, None])
        return kv_out, masks

    # -- training: many blocks per sequence in one pass ---------------------------------
    def train_forward(self, features, input_ids, anchors, anchor_valid, embed, lm_head, labels=None):
        """features [B, S, n*H]; input_ids [B, S]; anchors [B, A] (positions p, p <= S-B);
        anchor_valid [B, A] bool. Returns logits [B, A, Bk-1, V] for slots 1..Bk-1 (slot k
        drafts token p+k); with a copy head, its proposals are mixed in (the logits are then
        log-probabilities). ``lm_head`` None: the slots' final hidden states [B, A, Bk-1, H]
        instead, for a loss that applies the head itself, chunk by chunk (model/head_loss.py;
        never with a copy head). ``labels`` [B, A, Bk-1]: unused by DFlash (DSpark's Markov head
        reads them); the loss builds them (model/objective.py `slot_labels`)."""
        if lm_head is None:
            if self.copying:
                raise ValueError("a copy head mixes its proposals into the logits: pass the lm_head")
            return self.slot_hidden(features, input_ids, anchors, anchor_valid, embed)
        logits, h = self.slot_outputs(features, input_ids, anchors, anchor_valid, embed, lm_head)
        return self.add_copies(logits, h, input_ids, anchors, lm_head)

    def slot_outputs(self, features, input_ids, anchors, anchor_valid, embed, lm_head, ctx_kv=None):
        """train_forward without the copy head: (the drafter's own logits, the slots' final
        hidden [B, A, Bk-1, H]). The acceptance estimate scores both from one pass.
        ``ctx_kv``: the context's keys/values (`context_from_features` of ``features`` at
        positions 0..S-1), when the caller computed them once for several calls."""
        h = self.slot_hidden(features, input_ids, anchors, anchor_valid, embed, ctx_kv)
        Bsz, A, K, H = h.shape
        with compute_precision(embed.weight):
            # flatten to rows first: on the strided 4-D slice, matmul falls back to a bmm
            # against the 49k-row weight expanded per batch (CPU: ~2 s of a 3 s step)
            logits = lm_head(h.reshape(-1, H)).view(Bsz, A, K, -1)
        return logits, h

    def slot_hidden(self, features, input_ids, anchors, anchor_valid, embed, ctx_kv=None):
        """The scored slots' final-normed hidden states [B, A, Bk-1, H], in the compute dtype."""
        Bsz, S = input_ids.shape
        A, Bk = anchors.shape[1], self.cfg.block_size
        dev = input_ids.device
        pos = anchors[..., None] + torch.arange(Bk, device=dev)  # [B, A, Bk]
        block_ids = torch.full_like(pos, self.cfg.mask_token_id)
        block_ids[..., 0] = torch.gather(input_ids, 1, anchors)
        if self.attention == "flex":
            mask = self.layer_masks(lambda window: flex_block_mask(anchors, anchor_valid, S, Bk, window))
        else:
            mask = self.layer_masks(lambda window: self.block_mask(anchors, anchor_valid, S, Bk, window))

        with compute_precision(embed.weight):
            if ctx_kv is None:
                ctx = self.fuse(features.to(embed.weight.dtype))
                ctx_kv = self.context_kv(ctx, torch.arange(S, device=dev).expand(Bsz, S))
            h = self.blocks_hidden(embed(block_ids.view(Bsz, -1)), pos.view(Bsz, -1), ctx_kv, mask)
            return h.view(Bsz, A, Bk, -1)[:, :, 1:]  # slot 0 is the given anchor: never scored

    def add_copies(self, logits, hidden, input_ids, anchors, lm_head):
        """Logits [B, A, Bk-1, V] with the copy head's proposals mixed in (model/copy_head.py),
        from the slots' hidden [B, A, Bk-1, H]; unchanged without a copy head."""
        if not self.copying:
            return logits
        return self.copy(logits, hidden, input_ids, anchors, getattr(lm_head, "to_subset", None))

    def forward(self, features, slots, objective):
        """One batch's loss, as nanoGPT's ``model(X, Y) -> loss`` (what DDP wraps): (loss, accuracy,
        metrics), device tensors. ``slots``: the batch's scored slots (model/objective.py `Slots`),
        ``objective``: the loss settings and the per-slot loss every family shares (`DraftLoss`).
        A DFlash drafter's loss is that per-slot loss alone, the head chunk by chunk where asked."""
        if objective.chunked():
            hidden = self.train_forward(features, slots.ids, slots.anchors, slots.valid, objective.embed, None)
            return (*objective.chunked_loss(hidden, slots), {})
        logits = self.train_forward(features, slots.ids, slots.anchors, slots.valid, objective.embed, slots.head)
        return (*objective.slot_loss(logits, slots), {})

    # -- the held-out walk's decode hook (run/acceptance_estimate.py) ------------------------
    def walk_accepted(self, logits, hidden, input_ids, anchors, labels, ok, lm_head):
        """The drafts a verify step anchored at each of ``anchors`` [B, A] accepts, from one pass's
        slot logits and hidden [B, A, Bk-1, ...] (`slot_outputs`, through the served head): the
        leading slots whose draft, as our decoder drafts it, is the label (``ok``: the label exists).
        DFlash: each slot's argmax, a copy head's proposals mixed in."""
        return leading_matches(self.add_copies(logits, hidden, input_ids, anchors, lm_head).argmax(-1), labels, ok)

    @property
    def copying(self) -> bool:
        """Whether drafts mix in the copy head's proposals (it exists and is not switched off)."""
        return self.copy is not None and self.use_copy

    @staticmethod
    def block_mask(anchors, anchor_valid, S, Bk, window: int | None = None):
        """bool [B, 1, A*Bk, S + A*Bk]: block j sees context < p_j and its own block only.
        Invalid (padding) anchors still see their own block so softmax stays finite.
        ``window`` W (a sliding layer): besides, the query at position t = p_j + k sees key
        position j only when |t - j| <= W - 1 (vLLM's non-causal window, both sides)."""
        Bsz, A = anchors.shape
        dev = anchors.device
        ctx_ok = torch.arange(S, device=dev)[None, None, :] < anchors[..., None]  # [B, A, S]
        ctx_ok = ctx_ok & anchor_valid[..., None]
        blk = torch.arange(A, device=dev)
        own = (blk[:, None] == blk[None, :])  # [A, A]
        ctx_part = ctx_ok[:, :, None, :].expand(Bsz, A, Bk, S).reshape(Bsz, A * Bk, S)
        own_part = own[:, None, :, None].expand(A, Bk, A, Bk).reshape(A * Bk, A * Bk)
        if window:
            offs = torch.arange(Bk, device=dev)
            t = (anchors[..., None] + offs).reshape(Bsz, A * Bk)  # each query's position
            ctx_part = ctx_part & (t[..., None] - torch.arange(S, device=dev) < window)
            own_part = own_part & ((offs[:, None] - offs[None, :]).abs() < window).repeat(A, A)
        own_part = own_part[None].expand(Bsz, -1, -1)
        return torch.cat([ctx_part, own_part], dim=-1)[:, None]

    # -- inference: one block from a context cache --------------------------------------
    @torch.no_grad()
    def draft(self, anchor_id: torch.Tensor, anchor_pos: int, ctx_kv, embed, lm_head, context_ids=None):
        """anchor_id [B]; ctx_kv: per-layer (k, v) of context positions < anchor_pos;
        context_ids [B, anchor_pos + 1]: the tokens so far, anchor last (the copy head's
        source; required with one). Returns greedy draft ids for slots 1..Bk-1: [B, Bk-1]."""
        return self.draft_logits(anchor_id, anchor_pos, ctx_kv, embed, lm_head, context_ids).argmax(-1)

    @torch.no_grad()
    def draft_logits(self, anchor_id: torch.Tensor, anchor_pos: int, ctx_kv, embed, lm_head, context_ids=None):
        """What `draft` takes the argmax of: the slots' logits [B, Bk-1, V] (log-probabilities
        with a copy head). Sampling at temperature > 0 draws from them instead."""
        Bk, dev = self.cfg.block_size, anchor_id.device
        ids = torch.full((anchor_id.shape[0], Bk), self.cfg.mask_token_id, device=dev, dtype=torch.long)
        ids[:, 0] = anchor_id
        pos = (anchor_pos + torch.arange(Bk, device=dev)).expand(ids.shape[0], Bk)
        ctx_kv, mask = self.windowed_context(ctx_kv, anchor_pos)
        with compute_precision(embed.weight):
            h = self.blocks_hidden(embed(ids), pos, ctx_kv, mask)[:, 1:]
            logits = self.serving_head(lm_head)(h)
        if self.copying:  # outside autocast, as in training
            if context_ids is None:
                raise ValueError("a drafter with a copy head drafts from context_ids (the tokens so far)")
            at = torch.full((ids.shape[0], 1), anchor_pos, device=dev, dtype=torch.long)
            logits = self.add_copies(logits[:, None], h[:, None], context_ids, at, lm_head)[:, 0]
        return logits

    @torch.no_grad()
    def context_from_features(self, features: torch.Tensor, positions: torch.Tensor, embed) -> list[tuple]:
        """Inference: target features [B, C, n*H] -> per-layer context keys/values, computed
        in the same precision as training (see compute_precision)."""
        with compute_precision(embed.weight):
            return self.context_kv(self.fuse(features.to(embed.weight.dtype)), positions)


def leading_matches(drafts: torch.Tensor, labels: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Per block [...]: how many leading slots' drafts [..., K] equal their labels where ``ok``."""
    return ((drafts == labels) & ok).int().cumprod(-1).sum(-1)


class DraftVocabHead(nn.Module):
    """Logits over the draft vocabulary (rows `head` of token ids `ids`), scattered into the
    full vocabulary with -inf elsewhere: what vLLM's DFlash head computes from `lm_head` +
    `d2t` (target id = draft id + d2t[draft id])."""

    def __init__(self, head: torch.Tensor, ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head, self.ids, self.vocab_size = head, ids, vocab_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sub = F.linear(h, self.head.to(h.dtype))
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.scatter_(-1, self.ids.expand(*sub.shape[:-1], -1), sub)

