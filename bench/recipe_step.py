"""The DFlash recipe's training step at full size on one GPU: device time, achieved TFLOP/s and
MFU per stage, one speed lever at a time (issue 48).

The recipe (configs/paper-b16.yaml): 5 drafter layers, block 16, 512 anchors per sequence, 5
fused target layers, CE with the decay (gamma 7); here sequences of `--max-len` 2048 tokens
(every token valid, the first quarter a prompt without loss). Two target shapes, random Qwen3
weights written on the device with save_pretrained and loaded by the product's `load_target`
(SmolLM2's tokenizer; the rows past its 49,152 ids are padding, the first of them the MASK):

    1.5b   Qwen3-1.7B's geometry: 28 layers, hidden 2048, 16 heads, 8 KV heads, head_dim 128,
           intermediate 6144, vocab 151,936 (Qwen3's own: the head's cost as a real target has it;
           bench/gpu_check.py's 1.5B dir has SmolLM2's 49,152)
    8b     Qwen3-8B's: 36 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate
           12288, vocab 151,936
    tiny   the same code on the CPU in seconds (--cpu-smoke: CI runs it)
    demo   configs/demo.yaml's drafter side on SmolLM2-135M's geometry (random weights): block 4,
           16 anchors, batch 4, max_len 160, 2 drafter layers, 3 fused layers, loss_vocab 4096

What runs is what `dflash train` runs on one batch: the product's `model/features.py`
(target_features, pack; the drafter side unpacks), the drafter built by `model/build.py`, and
`run/step.TrainStep` (the loss: model/objective.py; backward; clip + fused AdamW + schedule).
Stages, each timed with a pair of CUDA events on the current stream (no sync inside the timed
steps; one synchronize after them, outside, reads every pair), or the host clock on the CPU:

    target_forward   model_forward: the frozen target's capture forward
    pack             pack_hidden: valid tokens only
    drafter_forward  unpack + the loss (anchors, drafter forward, head, loss)
    backward
    optimizer        clip, fused AdamW, the LR schedule

Arms (`--arms`), each adding one lever to the one before, each from the same weights and
batches (their first losses are printed side by side: equal to rounding):

    baseline       full-vocabulary logits (train.loss_chunk=-1), every target layer with
                   output_hidden_states (features.STOP_EARLY off), SDPA with a bool mask
    chunked_loss   the head + loss 4096 rows at a time (model/head_loss.py; train.loss_chunk's CUDA default)
    stop_early     the target forward stops after the deepest fused layer (model/features.py)
    flex           train.attention=flex (flex_attention, compiled block mask; CUDA only: no flex
                   backward on the CPU)
    fill           the fastest arm's levers, the batch doubled while it fits (peak under ~90% of
                   the device) and time remains: the batch that fills the device
    compile        train.compile (torch.compile of each drafter layer; CUDA only here), last:
                   its build is the slowest warm-up

Per arm: stage p50 device ms, TFLOP/s and MFU (against `--peak-tflops`, 989: the H200 SXM's
dense bf16 peak) from the FLOP model below, peak memory, tokens/s and samples/s (whole step,
and the drafter's side alone: SpecForge's "per trainer GPU" figure), and the queue: with both
sides on one GPU, the share of a step the drafter's side waits for the target's forward
(target / (target + drafter)); `target_per_drafter` is the ratio of target to drafter GPUs a
layout needs at these rates.

    bash .devkit/enter.sh python3 bench/recipe_step.py                 # the device run (docs/gpu.md)
    .venv/bin/python bench/recipe_step.py --cpu-smoke                  # CI: tiny shape, CPU, < 60 s
    .venv/bin/python bench/recipe_step.py --device cpu --shapes demo --arms baseline,chunked_loss \
        --rounds 5                                                     # CPU ratios, arms interleaved

Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's H200 SXM dense bf16 tensor-core peak (no sparsity)
STAGES = ("target_forward", "pack", "drafter_forward", "backward", "optimizer")


# -- the FLOP model ------------------------------------------------------------------------------
# Matmul FLOPs only (2 per multiply-add): norms, rotary, softmax and the loss's elementwise work
# are a few FLOPs per element against thousands per matmul output, and MFU conventionally
# leaves them out. Checked against a hand count and torch's FlopCounterMode on the real modules
# (tests/unit/test_recipe_flops.py).
@dataclass(frozen=True)
class Geometry:
    """A Qwen3-style decoder's sizes (the drafter's layers mirror the target's)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True  # lm_head = embedding (Qwen3-1.7B, SmolLM2); Qwen3-8B has its own head

    @property
    def attn_params(self) -> int:  # q, k, v, o
        H, D = self.hidden, self.head_dim
        return H * self.heads * D + 2 * H * self.kv_heads * D + self.heads * D * H

    @property
    def mlp_params(self) -> int:   # gate, up, down
        return 3 * self.hidden * self.intermediate


@dataclass(frozen=True)
class Recipe:
    """The drafter's side of a step: sequences x tokens, anchors per sequence, block size,
    drafter layers, fused target layers, the loss's logit columns, and the mean context a
    block's queries see (the mean anchor position: a block at p sees positions < p)."""
    seqs: int
    seq_len: int
    anchors: int
    block: int
    drafter_layers: int
    fused: int
    head_cols: int
    mean_context: float


def target_forward_flops(g: Geometry, seqs: int, seq_len: int, layers_run: int | None = None,
                         causal_fraction: float = 0.5) -> float:
    """A capture forward over `layers_run` decoder layers (all by default; no lm_head: the
    capture skips it): projections and MLP, 2 x params x tokens, and attention's QK^T and AV,
    4 x head_dim x heads per (query, key) pair, of which a causal mask keeps `causal_fraction`
    (0.5: FlashAttention's count; 1.0: what a dense kernel executes)."""
    L = g.layers if layers_run is None else layers_run
    tokens = seqs * seq_len
    proj = 2.0 * tokens * (g.attn_params + g.mlp_params)
    attn = 4.0 * g.heads * g.head_dim * seqs * seq_len * seq_len * causal_fraction
    return L * (proj + attn)


def drafter_flops(g: Geometry, r: Recipe, dense_attention: bool = False) -> dict:
    """Forward and backward FLOPs of the drafter's step, by part:

      fc          fusion Linear(n*H -> H) over every context token; backward: its weight only
                  (the target's features need no gradient)
      context_kv  each layer's k/v projections of the context; backward 2x (input and weight)
      block       each layer's q/k/v/o projections of the block tokens (A * B per sequence)
      mlp         each layer's MLP on the block tokens
      attention   the block queries over (context < p) + their own block: useful pairs
                  A * B * (mean_context + B) per sequence (`dense_attention`: every pair the
                  bool mask spans, A * B * (S + A * B), what SDPA with a mask executes)
      head        the frozen lm_head over the scored slots A * (B - 1); backward: input only
    Backward counts 2x a trainable matmul (grad input + grad weight) and 2x attention."""
    H, L = g.hidden, r.drafter_layers
    ctx_tokens = r.seqs * r.seq_len
    q_tokens = r.seqs * r.anchors * r.block
    scored = r.seqs * r.anchors * (r.block - 1)
    if dense_attention:
        pairs = q_tokens * (r.seq_len + r.anchors * r.block)
    else:
        pairs = q_tokens * (r.mean_context + r.block)
    fwd = {
        "fc": 2.0 * ctx_tokens * r.fused * H * H,
        "context_kv": L * 2.0 * ctx_tokens * H * 2 * g.kv_heads * g.head_dim,
        "block": L * 2.0 * q_tokens * g.attn_params,
        "mlp": L * 2.0 * q_tokens * g.mlp_params,
        "attention": L * 4.0 * g.heads * g.head_dim * pairs,
        "head": 2.0 * scored * H * r.head_cols,
    }
    bwd = {k: (1.0 if k in ("fc", "head") else 2.0) * v for k, v in fwd.items()}
    return {"forward": fwd, "backward": bwd, "forward_total": sum(fwd.values()),
            "backward_total": sum(bwd.values())}


def drafter_params(g: Geometry, drafter_layers: int, fused: int) -> int:
    """Trainable parameters: fc, the layers (projections, MLP, 4 norms), the final and hidden norms."""
    per_layer = g.attn_params + g.mlp_params + 2 * g.hidden + 2 * g.head_dim
    return fused * g.hidden * g.hidden + drafter_layers * per_layer + 2 * g.hidden


# -- shapes --------------------------------------------------------------------------------------
SHAPES = {
    # name: (target geometry, recipe overrides on configs/paper-b16.yaml, default batch)
    "1.5b": (Geometry(2048, 28, 16, 8, 128, 6144, 151936), [], 4),
    "8b": (Geometry(4096, 36, 32, 8, 128, 12288, 151936, tied=False), [], 2),
    "tiny": (Geometry(64, 6, 4, 2, 16, 128, 49152),
             ["model.num_layers=2", "model.block_size=4", "train.num_anchors=8", "model.num_target_layers=3"], 2),
    # tiny-qwen3's geometry with the recipe's block 16 and the full vocabulary: the CPU's view of
    # the levers whose effect a CPU shows (the logits' memory, the target's skipped layers)
    "cpu": (Geometry(256, 6, 4, 2, 64, 512, 49152),
            ["model.num_layers=1", "model.block_size=16", "train.num_anchors=32", "model.num_target_layers=3"], 2),
    "demo": (Geometry(576, 30, 9, 3, 64, 1536, 49152),
             ["model.num_layers=2", "model.block_size=4", "train.num_anchors=16", "model.num_target_layers=3",
              "train.loss_vocab=4096", "train.loss_gamma=1.5", "train.loss_weights=dpace"], 4),
}
BUDGET_WEIGHT = {"8b": 1.5}  # the 8B shape's share of the time budget, against 1 for the others
DEFAULT_MAX_LEN = {"1.5b": 2048, "8b": 2048, "tiny": 64, "cpu": 256, "demo": 160}

ARMS = {
    # name: (lever settings; each arm is the one before plus its lever). compile last: its build
    # is the slowest warm-up, and the first arm a short budget drops
    "baseline": dict(loss_chunk=-1, stop_early=False, attention="sdpa", compile=False),
    "chunked_loss": dict(loss_chunk=4096),
    "stop_early": dict(stop_early=True),
    "flex": dict(attention="flex"),
    "fill": dict(),
    "compile": dict(compile=True),
}
CUDA_ONLY = ("flex", "compile")


def arm_levers(names: list[str], cuda: bool = True, chunk: int = 4096) -> dict[str, dict]:
    """Each arm's settings: the baseline's, plus every lever of the arms up to it (in ARMS order;
    off CUDA without the CUDA-only ones); `chunk`: the chunked head's rows."""
    out, cur = {}, dict(ARMS["baseline"])
    for name in ARMS:
        if cuda or name not in CUDA_ONLY:
            cur = cur | ARMS[name] | ({"loss_chunk": chunk} if name == "chunked_loss" else {})
        if name in names:
            out[name] = dict(cur)
    return out


def make_target_dir(root: str, name: str, g: Geometry, device: str) -> str:
    """A random Qwen3 of geometry `g` written as a local HF dir with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash.model import target as T

    path = os.path.join(root, f"qwen3-{name}-random")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tok = T.load_tokenizer("tiny-qwen3")
    cfg = Qwen3Config(vocab_size=g.vocab, hidden_size=g.hidden, intermediate_size=g.intermediate,
                      num_hidden_layers=g.layers, num_attention_heads=g.heads, num_key_value_heads=g.kv_heads,
                      head_dim=g.head_dim, max_position_embeddings=8192, tie_word_embeddings=g.tied,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.device(device):  # init on the GPU: seconds, not minutes
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device != "cpu" else torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()  # the 8B's 16 GB go back before load_target reads them in again
    return path


# -- timing --------------------------------------------------------------------------------------
class StageClock:
    """Per (step, stage) a pair of CUDA events recorded on the current stream, read after one
    synchronize once the timed steps are done; on the CPU the host clock (its ops are synchronous)."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"
        self.pairs: list[tuple[str, object, object]] = []

    def stage(self, name: str):
        clock = self

        class _Span:
            def __enter__(self):
                if clock.cuda:
                    self.a = clock.torch.cuda.Event(enable_timing=True)
                    self.a.record()
                else:
                    self.a = time.perf_counter()

            def __exit__(self, *exc):
                if clock.cuda:
                    b = clock.torch.cuda.Event(enable_timing=True)
                    b.record()
                else:
                    b = time.perf_counter()
                clock.pairs.append((name, self.a, b))
        return _Span()

    def read(self) -> dict[str, list[float]]:
        """Seconds per stage (a list: one per timed step)."""
        if self.cuda:
            self.torch.cuda.synchronize()
        out: dict[str, list[float]] = {}
        for name, a, b in self.pairs:
            out.setdefault(name, []).append(a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


# -- one arm -------------------------------------------------------------------------------------
def recipe_config(target_dir: str, shape: str, batch: int, max_len: int, levers: dict, device="cpu"):
    from dflash.config import load_config

    _, extra, _ = SHAPES[shape]
    over = [f"model.target={target_dir}", f"data.max_len={max_len}", f"train.batch_size={batch}",
            "train.steps=1000", "train.warmup_ratio=0.04", f"train.loss_chunk={levers['loss_chunk']}",
            f"train.attention={levers['attention']}", f"train.compile={str(levers['compile']).lower()}",
            f"pipeline.target_devices={device}", f"pipeline.drafter_devices={device}", *extra]
    return load_config(os.path.join(ROOT, "configs", "paper-b16.yaml"), over)


def make_batch(index: int, batch: int, max_len: int, id_limit: int):
    """`batch` sequences of `max_len` random tokens (every token valid), the first quarter a
    prompt (loss mask 0): what collate hands the target worker."""
    import torch

    from dflash.data.batch import Batch

    g = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(0, id_limit, (batch, max_len), generator=g)
    lm = torch.ones_like(ids)
    lm[:, : max_len // 4] = 0
    return Batch(index=index, input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=lm,
                 lengths=[max_len] * batch)


def run_arm(torch, target, tok, target_dir: str, shape: str, levers: dict, *, batch: int, max_len: int,
            steps: int, warmup: int, device, seed_batches: int = 0) -> dict:
    """Build the drafter and its TrainStep with `levers`, run `warmup` untimed steps, then
    `steps` timed ones; returns stage seconds, losses, peak memory and the anchors' mean
    context (for the FLOP model)."""
    from dflash.model import features as Fm
    from dflash.model import target as T
    from dflash.model.build import build_drafter
    from dflash.model.loss_vocab import batch_vocab
    from dflash.model.losses import feature_ids
    from dflash.model.objective import anchor_generator, sample_anchors
    from dflash.run.step import TrainStep

    cfg = recipe_config(target_dir, shape, batch, max_len, levers, str(device))
    L = T.num_layers(target)
    layer_ids = T.default_layer_ids(L, cfg.model.num_target_layers)
    fids = feature_ids(cfg.train, layer_ids, False)
    Fm.STOP_EARLY = levers["stop_early"]
    with torch.device(device):  # built where it trains (a 1B-parameter init on the host takes seconds per arm);
        drafter = build_drafter(cfg, target, tok, layer_ids)  # seeded by train.seed: the same weights in every arm
    st = TrainStep(cfg.train, cfg.model.block_size, drafter, target.get_input_embeddings(),
                   target.get_output_embeddings(), device)
    if cfg.train.loss_vocab:  # the frequent set from a long random sample: loss_vocab ids, as a real corpus gives
        from dflash.data.sample import Sample
        ids = torch.randint(0, len(tok), (20 * cfg.train.loss_vocab,), generator=torch.Generator().manual_seed(7))
        st.use_loss_vocab([Sample(ids.tolist(), [1] * len(ids))])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, clock = [], StageClock(torch, device)
    t_wall = None
    for s in range(warmup + steps):
        if s == warmup:  # the timed region starts: nothing before it counts
            if device.type == "cuda":
                torch.cuda.synchronize()
            clock.pairs.clear()
            t_wall = time.perf_counter()
        b = make_batch(seed_batches + s, batch, max_len, len(tok))
        with clock.stage("target_forward"):
            feats = Fm.target_features(target, b, fids, device)
        with clock.stage("pack"):
            packed = Fm.pack(feats, b.lengths)
        with clock.stage("drafter_forward"):
            loss, _acc = st.forward(Fm.unpack(packed, b.lengths, b.padded_len), b)
        with clock.stage("backward"):
            st.backward(loss)
        with clock.stage("optimizer"):
            st.optimizer_step(loss)
        losses.append(loss.detach())
        del feats, packed, loss
    times = clock.read()  # synchronizes: after the timed steps
    wall = time.perf_counter() - t_wall
    anchors = [sample_anchors(make_batch(seed_batches + s, batch, max_len, len(tok)).loss_mask,
                              cfg.train.num_anchors, cfg.model.block_size,
                              generator=anchor_generator(cfg.train.seed, seed_batches + s))
               for s in range(warmup, warmup + steps)]
    mean_ctx = statistics.fmean(float(a[v].float().mean()) for a, v in anchors)
    head_cols = target.get_output_embeddings().weight.shape[0] if st.loss.loss_vocab is None else \
        statistics.fmean(len(batch_vocab(st.loss.loss_vocab, make_batch(seed_batches + s, batch, max_len,
                                                                         len(tok)).input_ids))
                         for s in range(warmup, warmup + steps))
    Fm.STOP_EARLY = True  # the product's setting, whatever the arm asked
    res = {"times": times, "wall_s": wall, "losses": [float(x) for x in losses],
           "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
           "mean_context": mean_ctx, "head_cols": head_cols, "layers_run": (max(layer_ids) + 1) if levers["stop_early"] else L,
           "cfg": cfg, "chunked": st.loss.chunked(), "params": sum(p.numel() for p in drafter.parameters())}
    del st, drafter
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def summarize(g: Geometry, res: dict, *, batch: int, max_len: int, peak: float) -> dict:
    """Stage p50 ms, TFLOP/s and MFU from the FLOP model, tokens/s, samples/s, the queue."""
    cfg = res["cfg"]
    t = {k: statistics.median(v) for k, v in res["times"].items()}
    r = Recipe(seqs=batch, seq_len=max_len, anchors=cfg.train.num_anchors, block=cfg.model.block_size,
               drafter_layers=cfg.model.num_layers, fused=cfg.model.num_target_layers, head_cols=round(res["head_cols"]),
               mean_context=res["mean_context"])
    df = drafter_flops(g, r)
    tf = target_forward_flops(g, batch, max_len, res["layers_run"])
    flops = {"target_forward": tf, "drafter_forward": df["forward_total"], "backward": df["backward_total"]}
    drafter_s = t["drafter_forward"] + t["backward"] + t["optimizer"]
    step_s = sum(t.values())
    stages = {}
    for k, secs in t.items():
        row = {"ms": round(secs * 1e3, 2)}
        if k in flops:
            row["tflops"] = _sig(flops[k] / secs / 1e12)
            row["mfu"] = _sig(flops[k] / secs / 1e12 / peak)
        stages[k] = row
    opt_bytes = res["params"] * 32  # read w, g, m, v and the clip's g; write w, m, v (fp32)
    stages["optimizer"]["gb_per_s"] = round(opt_bytes / t["optimizer"] / 1e9, 1)
    dflops = df["forward_total"] + df["backward_total"]
    return {
        "stages": stages,
        "drafter_step": {"ms": round(drafter_s * 1e3, 2), "tflops": _sig(dflops / drafter_s / 1e12),
                         "mfu": _sig(dflops / drafter_s / 1e12 / peak),
                         "samples_per_s": round(batch / drafter_s, 2)},
        "whole_step": {"ms": round(step_s * 1e3, 2), "mfu": _sig((dflops + tf) / step_s / 1e12 / peak),
                       "tokens_per_s": round(batch * max_len / step_s), "samples_per_s": round(batch / step_s, 2),
                       "wall_ms_per_step": round(res["wall_s"] / max(1, len(res["times"]["optimizer"])) * 1e3, 2)},
        "queue_share_one_gpu": round(t["target_forward"] / step_s, 3),
        "target_per_drafter": round((t["target_forward"] + t["pack"]) / drafter_s, 3),
        "flops_tera": {"target_forward": _sig(tf / 1e12), "drafter_forward": _sig(df["forward_total"] / 1e12),
                       "backward": _sig(df["backward_total"] / 1e12),
                       "head_share_of_drafter": round((df["forward"]["head"] + df["backward"]["head"]) / dflops, 3),
                       "attention_dense_over_useful": round(
                           drafter_flops(g, r, dense_attention=True)["forward"]["attention"]
                           / df["forward"]["attention"], 2)},
        "peak_mem_gb": res["peak_mem_gb"], "loss_first": round(res["losses"][0], 5),
        "chunked_head": res["chunked"], "layers_run": res["layers_run"], "mean_context": round(res["mean_context"], 1),
    }


# -- main ----------------------------------------------------------------------------------------
def bench_shape(torch, root: str, shape: str, arms: list[str], *, device, batch: int, max_len: int, steps: int,
                warmup: int, rounds: int, peak: float, deadline: float, threads_note: str, chunk: int = 4096) -> dict:
    from dflash.model import target as T

    g, _, _ = SHAPES[shape]
    t0 = time.monotonic()
    tdir = make_target_dir(root, shape, g, "cuda" if device.type == "cuda" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, tok = T.load_target(tdir, device=str(device), dtype=dtype)
    out = {"shape": asdict(g), "batch": batch, "max_len": max_len, "dtype": str(dtype).removeprefix("torch."),
           "setup_s": round(time.monotonic() - t0, 1), "arms": {}}
    levers = arm_levers(arms, cuda=device.type == "cuda", chunk=chunk)
    runs: dict[str, list] = {a: [] for a in levers}
    for rnd in range(rounds):  # rounds interleave the arms (a shared CPU drifts); the order flips each round
        order = list(levers) if rnd % 2 == 0 else list(levers)[::-1]
        for name in order:
            if time.monotonic() > deadline:
                out["arms"].setdefault(name, {"skipped": "time budget"})
                continue
            if name in CUDA_ONLY and device.type != "cuda":
                out["arms"][name] = {"skipped": "CUDA only (no flex backward on the CPU; compile: minutes to build)"}
                continue
            try:
                lever_set = name
                if name == "fill":  # the levers of the fastest arm so far (every lever, before any ran)
                    done = {k: min(r["drafter_step"]["ms"] for r in v) for k, v in runs.items() if v and k != "fill"}
                    lever_set = min(done, key=done.get) if done else "fill"
                    res, b = fill(torch, target, tok, tdir, shape, levers[lever_set], batch=batch, max_len=max_len,
                                  steps=steps, warmup=warmup, device=device, deadline=deadline)
                else:
                    res, b = run_arm(torch, target, tok, tdir, shape, levers[name], batch=batch, max_len=max_len,
                                     steps=steps, warmup=warmup, device=device), batch
            except torch.cuda.OutOfMemoryError as e:
                torch.cuda.empty_cache()
                out["arms"][name] = {"oom": str(e).splitlines()[0][:160], "batch": batch}
                continue
            runs[name].append(summarize(g, res, batch=b, max_len=max_len, peak=peak)
                              | {"batch": b, "levers": levers[lever_set] | {"of_arm": lever_set}})
    for name, rs in runs.items():
        if rs:
            out["arms"][name] = merge_rounds(rs)
    add_ratios(out, list(levers))
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["machine"] = threads_note
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def add_ratios(out: dict, order: list[str]) -> None:
    """Each lever's effect: this arm's drafter step and target forward over the previous arm's."""
    prev = out["arms"].get("baseline", {})
    for name in order:  # each lever's effect: this arm's drafter step and target forward over the previous arm's
        a = out["arms"].get(name, {})
        if "drafter_step" in a and "drafter_step" in prev and name != "baseline":
            a["vs_previous"] = {"drafter_step_ms": round(a["drafter_step"]["ms"] / prev["drafter_step"]["ms"], 3),
                                "target_forward_ms": round(a["stages"]["target_forward"]["ms"]
                                                           / prev["stages"]["target_forward"]["ms"], 3)}
            if a.get("peak_rss_mb") and prev.get("peak_rss_mb"):
                a["vs_previous"]["peak_rss_mb"] = round(a["peak_rss_mb"] - prev["peak_rss_mb"])
        if "drafter_step" in a:
            prev = a


def _sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (a CPU's TFLOP/s are 1e-3, an H200's hundreds)."""
    return float(f"{x:.{digits}g}")


def merge_rounds(rs: list[dict]) -> dict:
    """One arm over several rounds: the median round by drafter step time, every round's ms kept."""
    rs = sorted(rs, key=lambda r: r["drafter_step"]["ms"])
    mid = dict(rs[len(rs) // 2])
    mid["rounds"] = len(rs)
    mid["drafter_step_ms_per_round"] = [r["drafter_step"]["ms"] for r in rs]
    mid["target_forward_ms_per_round"] = [r["stages"]["target_forward"]["ms"] for r in rs]
    return mid


def fill(torch, target, tok, tdir, shape, levers, *, batch, max_len, steps, warmup, device, deadline):
    """The batch that fills the device: double it from `batch` while it fits (no OOM, peak under
    90% of the device) and time remains; the largest that ran."""
    best = None
    b = batch
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    while time.monotonic() < deadline:
        try:
            res = run_arm(torch, target, tok, tdir, shape, levers, batch=b, max_len=max_len, steps=steps,
                          warmup=warmup, device=device)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
        best = (res, b)
        if total is None or res["peak_mem_gb"] > 0.45 * total:  # doubling would pass ~90%
            break
        b *= 2
    if best is None:
        raise torch.cuda.OutOfMemoryError(f"batch {batch} does not fit")
    return best


def isolated(args, shape: str, arms: list[str], root: str) -> dict:
    """`--isolate` (CPU): every (round, arm) in a child process of its own, arms interleaved and
    the order flipped each round, so each arm's peak resident memory (wait4, bench/peak_rss.py) is its own: the
    CPU has no allocator statistics, and a process's peak never comes down."""
    import subprocess

    out: dict = {"arms": {}, "isolated": True}
    runs: dict[str, list] = {a: [] for a in arms}
    for rnd in range(args.rounds):
        for arm in (arms if rnd % 2 == 0 else arms[::-1]):
            cmd = [sys.executable, os.path.abspath(__file__), "--shapes", shape, "--arms", arm, "--rounds", "1",
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", "cpu",
                   "--chunk", str(args.chunk), "--target-root", root]
            for flag, v in (("--batch", args.batch), ("--max-len", args.max_len), ("--threads", args.threads)):
                if v:
                    cmd += [flag, str(v)]
            # reaped by peak_rss.py: straight from this process (torch imported) a small arm's peak would
            # read as ours, as Linux counts a child's pre-exec image in its ru_maxrss
            peak = os.path.join(root, f"peak-{arm}-{rnd}")
            cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak_rss.py"), peak,
                   "--", *cmd]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0 or not done.stdout.strip():
                sys.exit(f"recipe_step.py: the isolated {arm} arm (round {rnd}) exited {done.returncode}:\n"
                         f"{done.stderr[-2000:]}")
            res = json.loads(done.stdout.strip().splitlines()[-1])[shape]
            a = res["arms"][arm]
            if "stages" in a:
                with open(peak) as f:
                    a["peak_rss_mb"] = round(int(f.read()) / 2**20)
                runs[arm].append(a)
            out |= {k: res[k] for k in ("shape", "batch", "max_len", "dtype")}
    for arm, rs in runs.items():
        if rs:
            merged = merge_rounds(rs)
            merged["peak_rss_mb_per_round"] = [r["peak_rss_mb"] for r in rs]
            merged["peak_rss_mb"] = statistics.median(merged["peak_rss_mb_per_round"])
            out["arms"][arm] = merged
    add_ratios(out, arms)
    out["setup_s"] = 0
    return out


def paired(torch, shape: str, root: str, *, batch: int, max_len: int, pairs: int, chunk: int) -> dict:
    """`--paired N` (for a shared CPU, where whole arms drift apart with the other jobs' load):
    in one process, each lever against the step without it, alternating step by step (the
    order flipping every pair), so both sides of a pair see the same load; the median and
    quartiles of the per-pair time ratios. chunked_loss: the drafter's step (forward, backward,
    optimizer), two TrainSteps from the same weights; stop_early: the target's capture forward."""
    from dflash.model import features as Fm
    from dflash.model import target as T
    from dflash.model.build import build_drafter
    from dflash.model.losses import feature_ids
    from dflash.run.step import TrainStep

    g, _, _ = SHAPES[shape]
    tdir = make_target_dir(root, shape, g, "cpu")
    target, tok = T.load_target(tdir)
    dev = torch.device("cpu")
    base = arm_levers(["baseline"], cuda=False)["baseline"]
    steps = {}
    for name, chunk_rows in (("full", -1), ("chunked", chunk)):
        cfg = recipe_config(tdir, shape, batch, max_len, base | {"loss_chunk": chunk_rows})
        layer_ids = T.default_layer_ids(T.num_layers(target), cfg.model.num_target_layers)
        st = TrainStep(cfg.train, cfg.model.block_size, build_drafter(cfg, target, tok, layer_ids),
                       target.get_input_embeddings(), target.get_output_embeddings(), dev)
        if cfg.train.loss_vocab:
            from dflash.data.sample import Sample
            ids = torch.randint(0, len(tok), (20 * cfg.train.loss_vocab,), generator=torch.Generator().manual_seed(7))
            st.use_loss_vocab([Sample(ids.tolist(), [1] * len(ids))])
        steps[name] = st
    fids = feature_ids(cfg.train, layer_ids, False)

    def drafter_step(st, b, feats):
        t0 = time.perf_counter()
        loss, _ = st.forward(feats, b)
        st.backward(loss)
        st.optimizer_step(loss)
        return time.perf_counter() - t0

    def capture(stop, b):
        Fm.STOP_EARLY = stop
        t0 = time.perf_counter()
        Fm.target_features(target, b, fids, dev)
        return time.perf_counter() - t0

    ratios: dict[str, list] = {"chunked_loss": [], "stop_early": []}
    secs: dict[str, list] = {"full": [], "chunked": [], "all_layers": [], "stop_early": []}
    for i in range(pairs + 1):  # pair 0 warms up
        b = make_batch(i, batch, max_len, len(tok))
        feats = Fm.target_features(target, b, fids, dev)
        order = ("full", "chunked") if i % 2 == 0 else ("chunked", "full")
        t = {k: drafter_step(steps[k], b, feats) for k in order}
        order = (False, True) if i % 2 == 0 else (True, False)
        c = {k: capture(k, b) for k in order}
        if i:
            ratios["chunked_loss"].append(t["chunked"] / t["full"])
            ratios["stop_early"].append(c[True] / c[False])
            secs["full"].append(t["full"]), secs["chunked"].append(t["chunked"])
            secs["all_layers"].append(c[False]), secs["stop_early"].append(c[True])
    Fm.STOP_EARLY = True

    def q(xs):
        xs = sorted(xs)
        return {"median": round(statistics.median(xs), 3), "q1": round(xs[len(xs) // 4], 3),
                "q3": round(xs[(3 * len(xs)) // 4], 3)}
    return {"pairs": pairs, "batch": batch, "max_len": max_len, "chunk": chunk,
            "ratio_chunked_over_full_drafter_step": q(ratios["chunked_loss"]),
            "ratio_stop_early_over_all_layers_target_forward": q(ratios["stop_early"]),
            "median_ms": {k: round(statistics.median(v) * 1e3, 1) for k, v in secs.items()},
            "layers_run": f"{max(layer_ids) + 1} of {T.num_layers(target)}"}


def _peak(a: dict) -> str:
    """Peak memory: the device's allocator peak (GB), or an isolated CPU arm's resident peak (MB)."""
    if a.get("peak_mem_gb") is not None:
        return f"{a['peak_mem_gb']} GB"
    return f"{a['peak_rss_mb']:.0f} MB" if a.get("peak_rss_mb") else "-"


def table(results: dict) -> str:
    lines = []
    for shape, r in results.items():
        if not isinstance(r, dict) or "arms" not in r:
            continue
        lines.append(f"{shape}: batch {r['batch']} x {r['max_len']} tokens, {r['dtype']}, setup {r['setup_s']} s")
        lines.append(f"  {'arm':13s} {'batch':>5s} {'tgt ms':>8s} {'tgt MFU':>7s} {'fwd ms':>8s} {'bwd ms':>8s} "
                     f"{'opt ms':>7s} {'drafter MFU':>11s} {'smp/s dr':>8s} {'tok/s':>8s} {'queue':>5s} "
                     f"{'peak':>8s} {'loss0':>8s}")
        for name, a in r["arms"].items():
            if "stages" not in a:
                lines.append(f"  {name:13s} {json.dumps(a)}")
                continue
            s = a["stages"]
            lines.append(f"  {name:13s} {a['batch']:5d} {s['target_forward']['ms']:8.1f} {s['target_forward']['mfu']:7.4f} "
                         f"{s['drafter_forward']['ms']:8.1f} {s['backward']['ms']:8.1f} {s['optimizer']['ms']:7.1f} "
                         f"{a['drafter_step']['mfu']:11.4f} {a['drafter_step']['samples_per_s']:8.2f} "
                         f"{a['whole_step']['tokens_per_s']:8d} {a['queue_share_one_gpu']:5.2f} "
                         f"{_peak(a):>8s} {a['loss_first']:8.4f}")
    return "\n".join(lines)


def check_args(args) -> str | None:
    """The one line for the first bad argument, or None: checked before torch loads, so that
    nothing ends in a traceback written into the JSON after the target loaded, and a --out
    that cannot be written fails now, not after the whole run with its figures."""
    import re

    for flag, v, least in (("--threads", args.threads, 0), ("--paired", args.paired, 0),
                           ("--warmup", args.warmup, 0), ("--batch", args.batch, 0), ("--max-len", args.max_len, 0),
                           ("--chunk", args.chunk, 1)):
        if v < least:
            return f"{flag}={v}: expected an integer >= {least}"
    for flag, v in (("--peak-tflops", args.peak_tflops), ("--budget-s", args.budget_s)):
        if not (math.isfinite(v) and v > 0):
            return f"{flag}={v}: expected a finite number > 0"
    if args.device and not re.fullmatch(r"cpu|cuda(:[0-9]+)?", args.device):
        return f"--device={args.device!r}: expected cpu, cuda or cuda:N"
    if args.out:
        parent = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out):
            return f"--out={args.out!r}: a directory; expected a file to write the JSON to"
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            return f"--out={args.out!r}: its directory {parent} does not exist or cannot be written"
    if args.target_root and os.path.exists(args.target_root) and not os.path.isdir(args.target_root):
        return f"--target-root={args.target_root!r}: not a directory"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8b,1.5b", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--batch", type=int, default=0, help="sequences per step (0: the shape's default)")
    ap.add_argument("--max-len", type=int, default=0, help="tokens per sequence (0: the shape's default)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per arm")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first (compiles, autotuning)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the arms (CPU ratios: >= 3)")
    ap.add_argument("--device", default="", help="cuda (default where available) or cpu")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                    help="the device's dense bf16 peak for MFU (H200 SXM: 989)")
    ap.add_argument("--budget-s", type=float, default=320.0, help="stop starting arms after this many seconds")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--chunk", type=int, default=4096, help="rows per chunk of the chunked_loss arm (and after)")
    ap.add_argument("--isolate", action="store_true",
                    help="CPU: each (round, arm) in its own process, for its own peak resident memory")
    ap.add_argument("--target-root", default="", help="where the random target dirs are written (kept)")
    ap.add_argument("--paired", type=int, default=0,
                    help="CPU: N step-by-step alternating pairs per lever in one process (chunked_loss, stop_early)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="the same code on the CPU, tiny shape, every CPU arm, 1 timed step: checks the script")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    arms = [a for a in args.arms.split(",") if a]
    if args.cpu_smoke:
        shapes, args.device, args.steps, args.warmup, args.rounds = ["tiny"], "cpu", 1, 1, 1
    bad = [s for s in shapes if s not in SHAPES] + [a for a in arms if a not in ARMS]
    if bad or args.steps < 1 or args.rounds < 1:
        print(f"recipe_step: error: {', '.join(bad) or f'--steps={args.steps} / --rounds={args.rounds}'}: expected "
              f"shapes from {', '.join(SHAPES)}, arms from {', '.join(ARMS)}, steps and rounds >= 1", file=sys.stderr)
        return 2
    err = check_args(args)
    if err:
        print(f"recipe_step: error: {err}", file=sys.stderr)
        return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):  # before any target is written
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(args.device.partition(":")[2] or 0) >= count:
            have = f"{count} CUDA device(s)" if count else f"no CUDA device torch can use (torch {torch.__version__})"
            print(f"recipe_step: error: --device={args.device!r}: this host has {have}; expected cpu"
                  + (f" or cuda:0..{count - 1}" if count else ""), file=sys.stderr)
            return 2
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    note = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else f"cpu, {torch.get_num_threads()} torch threads, load {os.getloadavg()[0]:.1f}")
    results: dict = {"device": note, "torch": torch.__version__, "peak_tflops": args.peak_tflops}
    with tempfile.TemporaryDirectory(prefix="recipe-step-") as tmp:
        root = args.target_root or tmp
        for i, shape in enumerate(shapes):
            batch = args.batch or SHAPES[shape][2]
            max_len = args.max_len or DEFAULT_MAX_LEN[shape]
            # each shape its share of what is left of the budget (the 8B, the comparison, the most)
            weights = [BUDGET_WEIGHT.get(s, 1.0) for s in shapes[i:]]
            now = time.monotonic()
            try:
                if args.paired:
                    results[shape] = paired(torch, shape, root, batch=batch, max_len=max_len, pairs=args.paired,
                                            chunk=args.chunk)
                    continue
                if args.isolate:
                    make_target_dir(root, shape, SHAPES[shape][0], "cpu")
                    results[shape] = isolated(args, shape, arms, root)
                    continue
                results[shape] = bench_shape(torch, root, shape, arms, device=dev, batch=batch, max_len=max_len,
                                             steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                                             peak=args.peak_tflops,
                                             deadline=now + (deadline - now) * weights[0] / sum(weights),
                                             threads_note=note, chunk=args.chunk)
            except Exception as e:  # one shape's failure must not lose the other's figures
                import traceback
                results[shape] = {"error": repr(e)[:300], "traceback": traceback.format_exc()[-3000:]}
    results["total_s"] = round(time.monotonic() - t_start, 1)
    ran = [a for r in results.values() if isinstance(r, dict) for a in r.get("arms", {}).values() if "stages" in a]
    ran += [r for r in results.values() if isinstance(r, dict) and "pairs" in r]
    results["ok"] = bool(ran) and all("error" not in r for r in results.values() if isinstance(r, dict))
    print(table(results))
    text = json.dumps(results, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
