"""The held-out acceptance estimate: every `train.estimate_every` steps, the tau that decoding
the held-out prompts would give, per verify step as engines count it, from one no-grad drafter
pass over anchors at every reply position; no decoding.

The rows (`eval_prompt_rows`, built once at setup). The first `train.estimate_samples` held-out
eval prompts: the ones `train --eval` and `dflash eval RUN/checkpoint` decode first, their first
user turn cut to `eval.max_prompt_len` exactly as the eval cuts it (`prompts_for_eval`). Each is
followed by the target's greedy continuation: `eval.max_new_tokens` tokens and B - 2 more, past
an end-of-turn token too, so that every slot the last verify step drafts has its label (the
target's own token there). The continuation is generated batched and left-padded, as
regeneration is, and the target's features over the rows are captured in one forward; both
once. Decoding generates one prompt at a time: the tokens agree up to near-ties in the
target's logits (what the eval's losslessness check sees too).
Why not the held-out training samples the estimate read before: they are other conversations,
cut at `data.regen_max_prompt_len`, with replies as long as regeneration made them and ending at
an end-of-turn token whose successor is unknown, so their walk cannot equal the eval's decode.
The eval prompts are out of training already (`split_heldout`): no training sample is kept back
for the estimate any more. A capture run (`train --features`: no target model, no
conversations) has only its captured samples: it keeps `train.estimate_samples` of them out of
training as before (`held_out_rows`); each sample's reply is walked as a decode with
max_new_tokens = the reply's length would go, labels past the row's end counted as rejected.

The walk. At anchor i (reply token i: the block [token i, MASK x (B-1)], the context every
position before it) the drafter sees exactly what it sees while decoding, and the tokens after
it are the target's greedy ones; so acc(i), the number of leading slots whose greedy guess
equals the label, is what a verify step at i accepts. One pass scores anchors at every reply
position (the block mask gives each block its own context). The walk then does what
`speculative_generate` does: the prompt's forward gives reply token 0 and the first verify step
anchors there; a step at i counts acc(i) + 1 and moves to i + acc(i) + 1; there is no step once
max_new_tokens tokens are out (i >= max_new_tokens - 1) or an end-of-turn token is (i >= its
index); the last step counts in full, as the decode loop counts it. The walk runs on the device
by pointer doubling (log2 of the reply length gathers): nothing syncs the drafter's thread, and
the values come back through the deferred read-back.

Figures, pooled over the verify steps of all rows like `dflash eval`'s histogram (its
`tau_per_step`): tau = sum(accepted + 1) / steps, the histogram of accepted + 1, and
per-position acceptance (the share of steps that accepted draft position k). Up to near-ties
they are what decoding the same prompts gives (tests/unit/test_acceptance_estimate.py). Also
`tau_anchor_mean`: accepted + 1 averaged over every reply anchor instead of over the steps a
decode takes; the estimate reported that (over sampled anchors) before: it flatters, because
decoding takes more steps where acceptance is low.

A drafter with a copy head (model/copy_head.py) is walked with and without its copy proposals
from the same pass (`dflash eval` and `dflash eval --no-copy-head`); the best checkpoint
(run/best.py) is chosen by the served figure, without them.

Cost: up to max_new_tokens - 1 anchors per row (one per reply position the walk can reach: the
cap), each with B - 1 slots through the lm_head, which is most of it. The blocks go through in
chunks of at most ESTIMATE_LOGITS logits over one context, so memory stays bounded whatever
the lengths; the figures do not depend on the chunking.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..data.batch import Batch
from ..data.dataset import collate
from ..data.sample import Sample
from ..decode.evaluate import per_position, per_step_tau
from ..model.drafter import leading_matches
from ..model.features import target_features
from ..model.objective import slot_labels
from .readback import DeferredScalars
from .step import TrainStep

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..offline.feature_shards import FeatureStore
    from ..offline.train_from_features import FeatureSide
    from .best import BestKeeper

ESTIMATE_LOGITS = 1 << 26   # logits per chunk of blocks (256 MB in fp32)
CONVENTION = ("per verify step: sum(accepted + 1) / verify steps, pooled over the prompts, as engines "
              "count it (dflash eval's tau_per_step)")


@dataclass
class WalkRows:
    """What the estimate walks: right-padded rows (prompt + the target's tokens), per row the
    position of the first anchor (`start`: reply token 0) and the end of the walk (no verify
    step anchors at a position >= `stop`), and what the rows are (`source`, for the summary)."""
    batch: Batch
    start: list[int]
    stop: list[int]
    source: dict = field(default_factory=dict)


def continuation_length(max_new_tokens: int, block_size: int) -> int:
    """The target's tokens after each eval prompt that the walk reads: `eval.max_new_tokens` and
    B - 2 more, so the last verify step's every slot has its label (the module docstring)."""
    return max(1, max_new_tokens + block_size - 2)


def eval_prompt_rows(target: PreTrainedModel, tokenizer, convs: list, *, n: int, max_prompt_len: int,
                     max_new_tokens: int, block_size: int, pad_id: int, batch_size: int = 16,
                     cache=None) -> WalkRows:
    """The first ``n`` held-out conversations as the eval decodes them, and the target's greedy
    continuation (see the module docstring). ``cache`` (a `RegenCache.for_continuations`):
    continuations a run before made are read, not generated again (the demo's 64 prompts: 49 s
    generated, 17 s for the whole setup with them cached, on 2 cores), and new ones written.
    (Regeneration's workers, two batches of 32 at once, took 48.9 s against 49.9 s for one
    batch of 64: not used.)"""
    from ..data.dataset import prompts_for_eval
    from ..decode.evaluate import stop_token_ids
    from ..prep.regen_cache import prompt_key
    from ..prep.regenerate import greedy_continuations

    prompts = prompts_for_eval(tokenizer, convs[:n], max_prompt_len=max_prompt_len)
    length = continuation_length(max_new_tokens, block_size)
    keys = [prompt_key(p) for p in prompts]
    have = {}
    if cache is not None:
        rows_in_vocab = target.get_input_embeddings().weight.shape[0]
        have = {k: v for k, v in cache.load(set(keys), vocab_size=rows_in_vocab, max_new_tokens=length).items()
                if len(v) == length}  # exactly the length asked: a shorter one is no continuation of these
    todo = [i for i, k in enumerate(keys) if k not in have]
    made = greedy_continuations(target, [prompts[i] for i in todo], length, pad=pad_id, device=target.device,
                                batch_size=batch_size)
    if cache is not None and todo:
        try:
            cache.write_batch({keys[i]: g for i, g in zip(todo, made)})
        except OSError as e:  # the cache only saves the next run time: a full or read-only disk is no failure
            print(f"held-out estimate: its continuations were not cached ({cache.dir}: {e.strerror or e}); "
                  f"the next run generates them again", file=sys.stderr)
    have.update({keys[i]: g for i, g in zip(todo, made)})
    gens = [have[k] for k in keys]
    eos = stop_token_ids(target, tokenizer)
    start, stop = [], []
    for p, g in zip(prompts, gens):
        out = next((i for i, t in enumerate(g) if t in eos), len(g))  # decoding stops once it is out
        start.append(len(p))
        stop.append(len(p) + max(0, min(max_new_tokens - 1, out)))
    rows = [Sample(p + g, [0] * len(p) + [1] * len(g)) for p, g in zip(prompts, gens)]
    return WalkRows(collate(rows, pad_id, 0), start, stop,
                    {"rows": "held-out eval prompts", "max_new_tokens": max_new_tokens,
                     "max_prompt_len": max_prompt_len, "continuations_cached": len(keys) - len(todo)})


def held_out_rows(samples: list[Sample], *, pad_id: int) -> WalkRows:
    """Held-out training samples (a capture run): each walked over its first reply, from its
    first loss token to its last."""
    start, stop = [], []
    for s in samples:
        m = s.loss_mask
        first = next((i for i, x in enumerate(m) if x), len(m))
        end = first
        while end < len(m) and m[end]:
            end += 1
        start.append(first)
        stop.append(max(first, end - 1))  # the reply's last token drafts nothing it could check
    return WalkRows(collate(samples, pad_id, 0), start, stop, {"rows": "held-out training samples"})


def walk(acc: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """The anchors a decode verifies at: bool [R, L]. ``acc`` [R, L]: the drafts accepted at
    reply anchor i; ``limit`` [R]: no step at i >= limit. From anchor 0 a step at i moves to
    i + acc[i] + 1. Pointer doubling, on the device: after round k the first 2^k anchors of the
    path are marked (each round marks where the marked ones jump to, then doubles the jumps)."""
    R, L = acc.shape
    dev = acc.device
    idx = torch.arange(L, device=dev)
    inside = idx[None] < limit[:, None]
    sink = torch.full((R, 1), L, device=dev, dtype=torch.long)  # past the end; it stays there
    jump = torch.cat([torch.where(inside, idx + acc.long() + 1, L).clamp(max=L), sink], dim=1)
    seen = torch.zeros(R, L + 1, device=dev, dtype=torch.long)
    seen[:, 0] = 1
    for _ in range(L.bit_length()):  # 2^rounds >= L + 1: every node of the path
        seen = seen | torch.zeros_like(seen).scatter_add_(1, jump, seen).clamp(max=1)
        jump = jump.gather(1, jump)
    return seen[:, :L].bool() & inside


def _leading(logits, labels, ok):
    """Drafts a verify step accepts per block: leading slots whose greedy guess is the label."""
    return leading_matches(logits.argmax(-1), labels, ok)


class AcceptanceEstimate:
    def __init__(self, train_step: TrainStep, target: PreTrainedModel | FeatureSide, rows: WalkRows, *,
                 layer_ids: list[int], feature_store: FeatureStore | None, every: int):
        self.every, self.train_step, self.rows = every, train_step, rows
        self.batch = rows.batch
        dev = train_step.device
        if feature_store is not None:  # train --features: the held-out rows were captured too
            feature_store.attach(self.batch)
        with torch.no_grad():
            self.features = target_features(target, self.batch, layer_ids, target.device).to(dev)
        Bk = self.block_size = train_step.drafter.cfg.block_size
        R = len(rows.start)
        lim = torch.tensor([max(0, b - a) for a, b in zip(rows.start, rows.stop)])
        L = max(1, int(lim.max()) if R else 1)  # anchors per row: every reply position the walk can reach
        i = torch.arange(L)
        anchors = torch.tensor(rows.start)[:, None] + i
        valid = i[None] < lim[:, None]
        pos = anchors[..., None] + torch.arange(1, Bk)
        lengths = torch.tensor(self.batch.lengths)
        self.ids = self.batch.input_ids.to(dev)
        self.limit = lim.to(dev)
        self.anchors = torch.where(valid, anchors, 0).to(dev)
        self.valid = valid.to(dev)
        self.label_ok = ((pos < lengths[:, None, None]) & valid[..., None]).to(dev)
        # chunks of blocks with at most ESTIMATE_LOGITS logits: rows [r0, r1) x anchors [a0, a1)
        per_anchor = (Bk - 1) * train_step.lm_head.weight.shape[0]
        C = max(1, min(L, ESTIMATE_LOGITS // per_anchor))
        G = max(1, min(R, ESTIMATE_LOGITS // (C * per_anchor)))
        self.chunks = [((r, min(R, r + G)), [(a, min(L, a + C)) for a in range(0, L, C)]) for r in range(0, R, G)]
        self.readback = DeferredScalars()
        # (step, tau, [share of steps accepting position 1..B-1], tau without copies, details)
        self.history: list = []
        self.keeper: BestKeeper | None = None  # run/best.py: keeps the best checkpoint by this estimate

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _accepted_in_eval_mode(self, model):
        """_accepted with dropout and the like off, the model's mode put back after."""
        was_training = model.training
        model.eval()
        try:
            return self._accepted(model)
        finally:
            model.train(was_training)

    @torch.no_grad()
    def __call__(self, step: int) -> None:
        """Drafter thread, after an optimizer step: queue one estimate, collect finished ones."""
        acc, own = self._accepted_in_eval_mode(self.train_step.drafter)
        vals = self._walked(acc, "")
        if own is not None:  # a copy head's drafter: the same walk without its proposals
            vals |= self._walked(own, "own_")
        self.readback.put(step, **vals)
        if self.keeper is not None:  # the weights this estimate judges, until its value is known
            self.keeper.queued(step)
        self.collect()

    def _accepted(self, model):
        """Drafts accepted at every reply anchor [R, L], with the copy head's proposals and (a
        copy head's drafter) without them: one pass over one context, in chunks of blocks."""
        st = self.train_step
        R, S = self.ids.shape
        ctx_kv = model.context_from_features(self.features, torch.arange(S, device=self.ids.device).expand(R, S),
                                             st.embed)
        accs, owns = [], []
        for (r0, r1), spans in self.chunks:
            ids, feats = self.ids[r0:r1], self.features[r0:r1]
            kv = [(k[r0:r1], v[r0:r1]) for k, v in ctx_kv]
            acc, own = [], []
            for a0, a1 in spans:
                anchors, valid, ok = (t[r0:r1, a0:a1] for t in (self.anchors, self.valid, self.label_ok))
                # drafts are read through the served head (a draft vocabulary's rows, if any), as decoding reads them
                logits, hidden = model.slot_outputs(feats, ids, anchors, valid, st.embed,
                                                    model.serving_head(st.lm_head), ctx_kv=kv)
                labels = slot_labels(ids, anchors, self.block_size)
                # the family's decode hook: its drafts as our decoder drafts them (DFlash2's selector
                # chain, DSpark's Markov chain, a copy head's proposals)
                acc.append(model.walk_accepted(logits, hidden, ids, anchors, labels, ok, st.lm_head))
                if model.copying:
                    own.append(_leading(logits, labels, ok))
            accs.append(torch.cat(acc, 1))
            if own:
                owns.append(torch.cat(own, 1))
        return torch.cat(accs, 0), (torch.cat(owns, 0) if owns else None)

    def _walked(self, acc, prefix: str) -> dict:
        """Device scalars: the histogram of accepted + 1 over the walk's verify steps (h1..hB),
        and accepted + 1 averaged over every anchor (`anchor_mean`)."""
        steps = walk(acc, self.limit)
        onehot = torch.nn.functional.one_hot(acc.long().clamp(0, self.block_size - 1), self.block_size)
        hist = (onehot * steps[..., None]).sum((0, 1))
        anchor_mean = ((acc + 1) * self.valid).sum() / self.valid.sum().clamp_min(1)
        return {f"{prefix}h{a}": hist[a - 1] for a in range(1, self.block_size + 1)} | \
            {f"{prefix}anchor_mean": anchor_mean}

    def _hist(self, v: dict, prefix: str) -> dict:
        return {str(a): int(round(v[f"{prefix}h{a}"])) for a in range(1, self.block_size + 1)}

    def collect(self, blocking: bool = False) -> list:
        done = self.readback.drain_blocking() if blocking else self.readback.ready()
        for s, v in done:
            hist = self._hist(v, "")
            tau = per_step_tau(hist, self.block_size)
            no_copy = per_step_tau(self._hist(v, "own_"), self.block_size) if "own_h1" in v else None
            detail = {"histogram": hist, "verify_steps": sum(hist.values()), "tau_anchor_mean": v["anchor_mean"]}
            if no_copy is not None:
                detail["histogram_no_copy"] = self._hist(v, "own_")
            self.history.append((s, tau, per_position(hist, self.block_size), no_copy, detail))
            if self.keeper is not None:  # judged as served: without a copy head's proposals
                self.keeper.result(s, no_copy if no_copy is not None else tau)
        return done

    @torch.no_grad()
    def as_eval(self, model, *, eos: set, max_new_tokens: int, prompts: int, baseline: str, dtype: str) -> dict:
        """`dflash eval`'s figures for ``model`` on the first ``prompts`` rows, walked instead of
        decoded (`eval.decode: false`): each row's verify steps in order (accepted + 1 at every
        anchor the walk visits) and its output (the target's greedy tokens a decode would
        commit), so the result has eval's keys, `per_prompt_steps` included (what the engine's
        verdict replays); prompt lookup from the same outputs (its acceptance follows from them
        at T = 0). Equal to decoding up to the target's near-ties (tests/unit/test_acceptance_estimate.py);
        nothing is decoded, so losslessness is left to a decoder: the engine's verdict checks
        the served outputs against the target's own."""
        import time
        from types import SimpleNamespace

        from ..decode.evaluate import _Tally
        from ..model.prompt_lookup import METHOD, RULE, accepted_on_output

        t0 = time.perf_counter()
        acc, _ = self._accepted_in_eval_mode(model)
        steps = walk(acc, self.limit).cpu()
        acc = acc.cpu()
        B = self.block_size
        tallies = {"drafter": _Tally(B)} | ({"baseline": _Tally(B)} if baseline == "prompt_lookup" else {})
        n = min(prompts, len(self.rows.start))
        for r in range(n):
            a, b = self.rows.start[r], self.rows.stop[r]
            row = self.batch.input_ids[r, :self.batch.lengths[r]].tolist()
            prompt, gen = row[:a], row[a:]
            out = gen[:b - a + 1]  # the decode's tokens: max_new_tokens, or up to its end-of-turn token
            mine = [int(acc[r, i]) + 1 for i in range(len(steps[r])) if steps[r, i]]
            ways = {"drafter": mine}
            if "baseline" in tallies:
                ways["baseline"] = accepted_on_output(prompt, gen, max_new_tokens=max_new_tokens, block_size=B, eos=eos)
            for name, lengths in ways.items():
                res = SimpleNamespace(tokens=out, acceptance=lengths, tau=sum(lengths) / max(1, len(lengths)))
                tallies[name].add([{"id": f"held-out-{r}", "turn": 0, "res": res, "s": 0.0,
                                    "prompt_ids": prompt if name == "drafter" else None}])
        note = ("walked, not decoded (eval.decode: false): equal to decoding up to near-ties; the engine's "
                "verdict checks losslessness")
        res = tallies["drafter"].figures() | {
            "block_size": B, "prompts": n, "prompt_set": "held-out", "prompt_source": {"kind": "held_out"},
            "lossless": None, "lossless_note": note, "lossless_divergent_prompts": 0, "lossless_divergences": [],
            "dtype": dtype, "max_new_tokens": max_new_tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
            "confidence_threshold": 0.0,  # the walk drafts whole blocks (config.check_walked_eval)
            "per_prompt_steps": tallies["drafter"].steps, "stop_token_ids": sorted(eos), "interrupted": False,
            "prompts_cut": 0, "method": "walked", "wall_s": round(time.perf_counter() - t0, 2)}
        res["tokens_per_s"] = None  # nothing decoded
        if "baseline" in tallies:
            res["baseline"] = {"method": METHOD, "rule": RULE} | tallies["baseline"].figures() | {
                "lossless": None, "per_prompt_steps": tallies["baseline"].steps, "tokens_per_s": None}
        return res

    def latest(self):
        return self.history[-1] if self.history else None

    def saved(self) -> list:
        """The history collected so far, as trainer_state.json holds it: a resumed run's summary
        carries the earlier part's points on (`restore`)."""
        return [list(h) for h in self.history]

    def restore(self, saved) -> None:
        """A resumed run starts from the points its checkpoint saved (`saved`); malformed ones
        (an older checkpoint has none) are left out, not fatal."""
        self.history = [tuple(h) for h in saved or [] if isinstance(h, (list, tuple)) and len(h) == 5]

    def summary(self) -> dict:
        self.collect(blocking=True)
        out = {"every": self.every, "held_out_sequences": len(self.batch.lengths), **self.rows.source,
               "convention": CONVENTION, "history": [[s, round(t, 4)] for s, t, *_ in self.history], "last": None}
        if self.history:
            step, tau, per_pos, no_copy, detail = self.history[-1]
            out["last"] = {"step": step, "tau": round(tau, 4), "per_position_acceptance": per_pos,
                           "verify_steps": detail["verify_steps"], "histogram": detail["histogram"],
                           "tau_anchor_mean": round(detail["tau_anchor_mean"], 4)}
            if no_copy is not None:  # a copy head's drafter: the same walk without its proposals
                out["history_no_copy"] = [[s, round(nc, 4)] for s, _, _, nc, _ in self.history]
                out["last"]["tau_no_copy"] = round(no_copy, 4)
        return out
