"""Draft-then-verify speculative decoding with a DFlash drafter: greedy (lossless), and
at temperature > 0 (`speculative_sample`, at the end).

One step: the drafter fills a block [anchor, MASK x (B-1)] from the context features of
every committed token before the anchor; the target verifies the whole block in one
forward; we keep the longest prefix the target agrees with plus the target's bonus
token. Acceptance length of the step = accepted drafts + 1 (so 1..B).

How the target's state follows the committed sequence (`_TargetRunner`, mode):
- ``crop``: attention-only targets keep a KV cache across steps and crop it back after a
  partial accept.
- ``snapshot``: hybrid targets (Gated-DeltaNet / linear-attention layers: qwen3_5,
  qwen3_next) keep a recurrent and a conv state that cannot be cropped. Before a verify
  we clone those states (a few KB per layer); after a partial accept we put them back and
  crop the attention layers' KV, so the cache lags the sequence by the accepted tokens;
  those go in front of the next verify's block (one forward per step, not a verify plus
  a replay), or are replayed on their own once there are a block's worth. A verify step
  costs O(block), not O(sequence).
- ``rerun``: no cache; every forward re-runs the whole committed sequence. O(length) per
  step; kept as the reference the snapshot path is tested against (and, in
  bench/hybrid_verify.py, as the old path: every row's logits at once).

On the CPU the cached modes project the target's hidden states through the lm_head only
for the rows the acceptance test reads (`lazy_logits`: on a small target the lm_head over a
block costs more than its layers).

Precision: the target runs in its own dtype; the drafter computes in that dtype too (fp32
master weights, autocast; see drafter.compute_precision), exactly as in training.

Losslessness (what `evaluate` checks): the speculative output must equal the target's
own greedy decode, one token per forward, through the same cache implementation, dtype
and device (`greedy_generate`). In float32 they agree exactly. In bf16 a verify forward
over a 16-token block reduces in a different order than a 1-token decode step, so where
the target's top-2 logits are within rounding of each other the argmax can flip; we then
report how many prompts diverged and the first divergent position with the reference's
top-1/top-2 logit margin there (a near-tie, not a drafting bug, when that margin is tiny).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..model import lazy_logits
from ..model.drafter import DFlashDrafter
from ..model.prompt_lookup import PromptLookup
from . import sampling

try:  # transformers >= 5: hybrid caches keep linear-attention layers of this kind
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin
except ImportError:  # pragma: no cover - older transformers: no snapshot path
    DynamicLayer = LinearAttentionCacheLayerMixin = None

MODES = ("auto", "crop", "snapshot", "rerun")


@dataclass
class DecodeResult:
    tokens: list[int]
    acceptance: list[int] = field(default_factory=list)  # per verify step, 1..B
    drafted: list[int] = field(default_factory=list)     # per verify step, the draft tokens it verified

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(1, len(self.acceptance))


def _features(out, layer_ids):
    """The fused layers' hidden states; None for a drafter that reads none (prompt lookup)."""
    if not layer_ids:
        return None
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def _last(feats, n: int):
    return None if feats is None else feats[0, -n:]


@functools.lru_cache(maxsize=None)
def _cache_arg(model_cls) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x: use what this one takes."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(model_cls) -> bool:
    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def _cache_kw(target, cache) -> dict:
    return {_cache_arg(type(target)): cache}


def _new_cache(target):
    try:
        return DynamicCache(config=target.config)
    except TypeError:
        return DynamicCache()


def _is_linear(layer) -> bool:
    return LinearAttentionCacheLayerMixin is not None and isinstance(layer, LinearAttentionCacheLayerMixin)


def cache_mode(target) -> str:
    """The cheapest exact mode this target supports (see the module docstring)."""
    cache = _new_cache(target)
    layers = getattr(cache, "layers", [])
    if any(_is_linear(layer) for layer in layers):
        return "snapshot"
    return "crop" if getattr(cache, "is_croppable", True) else "rerun"


class _TargetRunner:
    """Target forwards that return (next-token argmax ids, features) for new tokens only.

    The ids are a list, or (cached modes on the CPU) a `lazy_logits.LazyArgmax` that runs
    the lm_head only for the positions read."""

    def __init__(self, target, layer_ids, mode: str = "auto", max_pending: int = 16):
        if mode not in MODES:
            raise ValueError(f"cache mode {mode!r}: expected one of {', '.join(MODES)}")
        self.target, self.layer_ids = target, layer_ids
        self.mode = cache_mode(target) if mode == "auto" else mode
        self.cache = None if self.mode == "rerun" else _new_cache(target)
        self.seq: list[int] = []  # tokens whose target forward is committed
        # snapshot mode: the cache may lag the committed sequence by `pending` tokens (those
        # kept from a partially accepted block); they go in front of the next forward instead
        # of a replay forward of their own, until there are max_pending of them
        self.pending: list[int] = []
        self.max_pending = max_pending
        self._saved = None        # linear-attention states as they were before the last forward
        # the decoder alone, its lm_head applied per row read (None: the whole model, every row)
        self.decoder = target.get_decoder() if self.cache is not None and lazy_logits.supported(target) else None

    def _run(self, ids: list[int], *, hidden: bool, keep: int = 1):
        t = torch.tensor([ids], device=self.target.device)
        kw = dict(output_hidden_states=True) if hidden else {}
        if _takes_logits_to_keep(type(self.target)):  # the lm_head only where logits are read
            kw["logits_to_keep"] = keep
        if self.cache is None:
            return self.target(input_ids=t, use_cache=False, **kw)
        return self.target(input_ids=t, **_cache_kw(self.target, self.cache), use_cache=True, **kw)

    def _run_decoder(self, ids: list[int], *, hidden: bool):
        """The decoder alone (no lm_head) through the cache: final hidden states, and all
        layers' if `hidden`."""
        t = torch.tensor([ids], device=self.target.device)
        kw = dict(output_hidden_states=True) if hidden else {}
        return self.decoder(input_ids=t, **_cache_kw(self.decoder, self.cache), use_cache=True, **kw)

    def forward(self, new_tokens: list[int]):
        n = len(new_tokens)
        if self.decoder is None:
            out = self._forward_model(new_tokens)
            return out.logits[0, -n:].argmax(-1).tolist(), _last(_features(out, self.layer_ids), n)
        if self.mode == "snapshot":
            self._saved = self._snapshot()
        out = self._run_decoder(self.pending + new_tokens, hidden=bool(self.layer_ids))
        preds = lazy_logits.LazyArgmax(out.last_hidden_state[0, -n:], self.target.get_output_embeddings())
        return preds, _last(_features(out, self.layer_ids), n)

    def forward_logits(self, new_tokens: list[int]):
        """`forward`, but the logits of every new token ([n, V]) instead of their argmax:
        sampling reads whole distributions (`speculative_sample`)."""
        n = len(new_tokens)
        out = self._forward_model(new_tokens)
        return out.logits[0, -n:], _last(_features(out, self.layer_ids), n)

    def _forward_model(self, new_tokens: list[int]):
        """The whole model (lm_head included) over the new tokens, through the cache if any."""
        n, hidden = len(new_tokens), bool(self.layer_ids)
        if self.cache is None:
            return self._run(self.seq + new_tokens, hidden=hidden, keep=n)
        if self.mode == "snapshot":
            self._saved = self._snapshot()
        return self._run(self.pending + new_tokens, hidden=hidden, keep=n)

    def commit(self, tokens: list[int], kept: int):
        """tokens were forwarded; only the first `kept` of them stay in the sequence."""
        self.seq.extend(tokens[:kept])
        if self.cache is None:
            return
        if self.mode == "crop":
            extra = self.cache.get_seq_length() - len(self.seq)
            if extra > 0:  # transformers 5 crops by a negative count of tokens to drop
                self.cache.crop(-extra)
            return
        saved, self._saved = self._saved, None
        if kept == len(tokens) or saved is None:
            self.pending = []  # the whole forward stays: the states after it are the right ones
            return
        # back to the states before that forward (which lacked the old pending tokens too)
        self._restore(saved, len(self.seq) - kept - len(self.pending))
        self.pending = self.pending + tokens[:kept]
        if len(self.pending) >= self.max_pending:  # bound the next forward: replay them now
            if self.decoder is not None:  # nothing reads its logits
                self._run_decoder(self.pending, hidden=False)
            else:
                self._run(self.pending, hidden=False)
            self.pending = []

    # -- snapshot mode -------------------------------------------------------------------
    def _snapshot(self) -> list:
        """Clones of every linear-attention layer's conv and recurrent states (None where a
        layer has no state yet). Attention KV needs no copy: it is cropped instead."""
        saved = []
        for layer in self.cache.layers:
            if not _is_linear(layer):
                saved.append(None)
                continue
            states = {}
            for i in range(layer.number_of_states):
                if layer.has_previous_state[i]:
                    conv, rec = layer.conv_states[i], layer.recurrent_states[i]
                    states[i] = (None if conv is None else conv.clone(), None if rec is None else rec.clone())
                else:
                    states[i] = None
            saved.append(states)
        return saved

    def _restore(self, saved: list, length: int) -> None:
        """Back to the cache as it was before the last forward, `length` tokens long."""
        for layer, states in zip(self.cache.layers, saved):
            # transformers >= 5.25 counts a linear layer's tokens itself, and a hybrid model
            # takes its positions from the first layer's count (a linear one in qwen3_5): put
            # it back too, or every later position (RoPE, mask) is off by the rejected drafts
            count = getattr(layer, "cumulative_length_linear", None)
            if isinstance(count, torch.Tensor):
                count.fill_(length)
            if states is not None:
                for i, st in states.items():
                    if st is None:  # the layer had no state before: forget what the verify wrote
                        layer.reset()
                        continue
                    for store, val in zip((layer.conv_states, layer.recurrent_states), st):
                        if val is None:
                            continue
                        if store[i] is not None and store[i].shape == val.shape:
                            store[i].copy_(val)  # in place: keeps the cache's static addresses
                        else:
                            store[i] = val
            if isinstance(layer, DynamicLayer):  # attention KV (also of a combined layer): crop
                extra = DynamicLayer.get_seq_length(layer) - length
                if extra > 0 and _is_linear(layer):
                    DynamicLayer.crop(layer, -extra)  # its own crop() is the linear one, which refuses
                elif extra > 0:
                    layer.crop(-extra)


def grow_context(drafter, ctx_kv, new_feats, n: int, embed):
    """The drafter's per-layer context keys/values, extended by the features of the newly
    committed positions n - len(new_feats) .. n - 1 (position-wise: exact to append)."""
    pos = torch.arange(n - new_feats.shape[0], n, device=new_feats.device)[None]
    kv = drafter.context_from_features(new_feats[None], pos, embed)
    return kv if ctx_kv is None else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                      for (k0, v0), (k1, v1) in zip(ctx_kv, kv)]


def copy_source(drafter, seq: list[int], anchor: int, dev) -> dict:
    """A copy head drafts from the tokens so far too (model/copy_head.py)."""
    if not getattr(drafter, "copying", False):
        return {}
    return {"context_ids": torch.tensor([seq + [anchor]], device=dev)}


class _DrafterSource:
    """A verify step's draft from a DFlash-family drafter: its context keys/values grow by the
    target features of the newly committed positions, then it fills one block (its family's
    `draft` / `sample_chain`: DFlash2's selector walk, DSpark's Markov chain). ``threshold`` > 0
    (a DSpark drafter with a confidence head): it drafts only while the head expects the drafts
    so far to be accepted (model/dspark.py `chain`), so a block may be shorter."""

    def __init__(self, drafter: DFlashDrafter, target, threshold: float = 0.0):
        self.drafter = drafter
        self.gate = {"threshold": threshold} if threshold > 0 else {}
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.layer_ids, self.block_size = drafter.cfg.target_layer_ids, drafter.cfg.block_size
        self.ctx_kv = None  # the drafter's per-layer context keys/values, grown by the new positions only

    def _args(self, seq, anchor, new_feats):
        n, dev = len(seq), new_feats.device
        self.ctx_kv = grow_context(self.drafter, self.ctx_kv, new_feats, n, self.embed)
        return (torch.tensor([anchor], device=dev), n, self.ctx_kv, self.embed, self.lm_head), \
            copy_source(self.drafter, seq, anchor, dev)

    def greedy(self, seq: list[int], anchor: int, new_feats) -> list[int]:
        args, kw = self._args(seq, anchor, new_feats)
        return self.drafter.draft(*args, **kw, **self.gate)[0].tolist()

    def sample(self, seq: list[int], anchor: int, new_feats, dist, generator):
        """(drafted tokens, q: the distribution they were drawn from, [K, V])."""
        args, kw = self._args(seq, anchor, new_feats)
        if hasattr(self.drafter, "sample_chain"):  # DFlash2 / DSpark: each slot drawn given the one before it
            tokens, q = self.drafter.sample_chain(*args, dist, generator, **self.gate)
            return tokens.tolist(), q
        q = dist(self.drafter.draft_logits(*args, **kw)[0])
        return sampling.draw(q, generator).tolist(), q


class _LookupSource:
    """A verify step's draft from prompt lookup (model/prompt_lookup.py): up to B - 1 tokens
    of the committed sequence plus the anchor, none when nothing matches (the verify is then
    a plain decode step). No target features are read."""

    layer_ids: list = []

    def __init__(self, lookup: PromptLookup):
        self.lookup, self.block_size = lookup, lookup.block_size

    def greedy(self, seq: list[int], anchor: int, new_feats) -> list[int]:
        return self.lookup.propose(seq + [anchor])

    def sample(self, seq: list[int], anchor: int, new_feats, dist, generator):
        return self.greedy(seq, anchor, new_feats), None  # q None: a point mass on each draft token


def draft_source(drafter, target, threshold: float = 0.0):
    """What drafts a verify step's block: a DFlash drafter or prompt lookup, one loop for both."""
    return _LookupSource(drafter) if isinstance(drafter, PromptLookup) else _DrafterSource(drafter, target, threshold)


@torch.no_grad()
def speculative_generate(target, drafter: DFlashDrafter | PromptLookup, prompt: list[int], *, max_new_tokens: int,
                         eos_ids: set[int] = frozenset(), mode: str = "auto", stop=None,
                         confidence_threshold: float = 0.0) -> DecodeResult:
    """``drafter``: a DFlash drafter or `PromptLookup` (the baseline): the same target
    verify and acceptance rule either way. ``stop`` (a threading.Event): set, the decode
    returns after the current verify step (a signal must not wait for a long prompt to finish).
    ``confidence_threshold``: a DSpark drafter's confidence-gated drafting (`_DrafterSource`)."""
    source = draft_source(drafter, target, confidence_threshold)
    B = source.block_size
    runner = _TargetRunner(target, source.layer_ids, mode, max_pending=B)

    preds, feats = runner.forward(prompt)
    runner.commit(prompt, len(prompt))
    new_feats = feats  # features of committed positions not yet in the drafter's context cache
    out: list[int] = [int(preds[-1])]
    acceptance: list[int] = []
    drafted: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in eos_ids and not (stop is not None and stop.is_set()):
        anchor = out[-1]
        draft = source.greedy(runner.seq, anchor, new_feats)  # B - 1 tokens (prompt lookup: up to)
        block = [anchor] + draft
        preds, feats = runner.forward(block)  # ids read as far as the drafts hold (lazily on the CPU)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == preds[accepted]:
            accepted += 1
        runner.commit(block, accepted + 1)
        new_feats = None if feats is None else feats[: accepted + 1]
        new = draft[:accepted] + [preds[accepted]]
        acceptance.append(accepted + 1)
        drafted.append(len(draft))
        for t in new:  # stop exactly where plain greedy decoding would
            out.append(t)
            if len(out) >= max_new_tokens or t in eos_ids:
                break
    return DecodeResult(tokens=out[:max_new_tokens], acceptance=acceptance, drafted=drafted)


@torch.no_grad()
def greedy_generate(target, prompt: list[int], *, max_new_tokens: int, eos_ids: set[int] = frozenset(),
                    mode: str = "auto", margins: list | None = None, stop=None) -> list[int]:
    """The target's own greedy output, one token per forward: the losslessness reference.

    Decodes through the same cache implementation, dtype and device as speculative decoding
    (a one-token step never needs a crop or a snapshot, so every mode but ``rerun`` simply
    keeps the cache). ``margins``, when given, receives the top-1 minus top-2 logit of every
    step: how close to a tie each greedy choice was."""
    runner = _TargetRunner(target, [], "rerun" if mode == "rerun" else "crop")
    if runner.mode != "rerun":
        runner.cache = _new_cache(target)
    out: list[int] = []
    new = list(prompt)
    while len(out) < max_new_tokens and not (stop is not None and stop.is_set()):
        if runner.cache is not None:
            logits = runner._run(new, hidden=False).logits
        else:
            logits = runner._run(runner.seq + new, hidden=False).logits
        runner.seq.extend(new)
        last = logits[0, -1].float()
        if margins is not None:
            top = last.topk(2).values
            margins.append(float(top[0] - top[1]))
        t = int(last.argmax())
        out.append(t)
        if t in eos_ids:
            break
        new = [t]
    return out


@torch.no_grad()
def greedy_divergence(target, prompt: list[int], output: list[int], *, max_new_tokens: int,
                      eos_ids: set[int] = frozenset(), rows: int = 256) -> tuple[int, float] | None:
    """Where `output` first departs from the target's greedy decode of `prompt`, and the
    greedy choice's top-1 minus top-2 logit there; None when it is the greedy decode.

    One teacher-forced forward over prompt + output instead of a decode of its own: greedy
    decoding picks y_t = argmax p(. | prompt, y_<t), so an output is the greedy one exactly
    when each of its tokens is the argmax given those before it, and it ends where greedy
    would (at an EOS, or at max_new_tokens). The first token that is not the argmax is
    where the two decodes part; up to it they are the same. The logits come in chunks of
    `rows` positions (the lm_head over a long output at once would hold outputs x vocab).
    Rounding: a forward over the whole sequence reduces in another order than one-token
    steps, so a near-tie can tip; the margin says how near (see the module docstring)."""
    n = len(output)
    if n == 0:
        return None
    ids = torch.tensor([list(prompt) + list(output[:-1])], device=target.device)
    if lazy_logits.supported(target):
        hidden = target.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, -n:]
        head = target.get_output_embeddings()
        logits_of = lambda a, b: head(hidden[a:b]).float()  # noqa: E731
    else:
        kw = {"logits_to_keep": n} if _takes_logits_to_keep(type(target)) else {}
        full = target(input_ids=ids, use_cache=False, **kw).logits[0, -n:]
        logits_of = lambda a, b: full[a:b].float()  # noqa: E731
    for a in range(0, n, rows):
        logits = logits_of(a, min(n, a + rows))
        top = logits.topk(2, dim=-1)
        want = torch.tensor(output[a:a + rows], device=logits.device)
        bad = torch.nonzero(top.indices[:, 0] != want).flatten()
        if len(bad):
            k = int(bad[0])
            return a + k, float(top.values[k, 0] - top.values[k, 1])
        if a + rows >= n:
            break
    stopped_early = n < max_new_tokens and output[-1] not in eos_ids   # greedy would have gone on
    ends_late = any(t in eos_ids for t in output[:-1])                  # greedy would have stopped sooner
    if ends_late:
        return next(i for i, t in enumerate(output) if t in eos_ids) + 1, float("nan")
    return (n, float("nan")) if stopped_early else None


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- temperature > 0 ----------------------------------------------------------------
# Speculative decoding at temperature > 0: draft by sampling, verify by the
# speculative-sampling rule (decode/sampling.py), so the output is distributed as plain
# sampling from the target.
#
# The same loop as the greedy `speculative_generate` (one drafter block from the
# committed context, one target forward over it, the target's cache cropped or restored to
# what was kept); only the choice of tokens differs: drafts are drawn from the drafter's
# processed distribution q, and acceptance is random. tau is then what a server running at
# that temperature would see. A seeded `torch.Generator` makes a run repeatable.

@torch.no_grad()
def speculative_sample(target, drafter: DFlashDrafter | PromptLookup, prompt: list[int], *, max_new_tokens: int,
                       temperature: float, top_p: float = 1.0, top_k: int = 0,
                       eos_ids: set[int] = frozenset(), mode: str = "auto",
                       generator: torch.Generator | None = None, stop=None,
                       confidence_threshold: float = 0.0) -> DecodeResult:
    """``drafter``: a DFlash drafter, or `PromptLookup` whose proposal is a point mass (q =
    one-hot: accepted with probability p(x)). ``stop`` (a threading.Event): set, return
    after the current verify step."""
    source = draft_source(drafter, target, confidence_threshold)
    B = source.block_size
    runner = _TargetRunner(target, source.layer_ids, mode, max_pending=B)

    def dist(logits):  # on the CPU: the generator and the rule's host reads live there
        return sampling.probs(logits.float().cpu(), temperature, top_p, top_k)

    logits, new_feats = runner.forward_logits(prompt)
    runner.commit(prompt, len(prompt))
    out = [int(sampling.draw(dist(logits[-1]), generator))]
    acceptance: list[int] = []
    drafted: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in eos_ids and not (stop is not None and stop.is_set()):
        anchor = out[-1]
        draft, q = source.sample(runner.seq, anchor, new_feats, dist, generator)
        block = [anchor] + draft
        logits, feats = runner.forward_logits(block)
        accepted, nxt = sampling.accept_block(draft, dist(logits), q, generator)
        runner.commit(block, accepted + 1)
        new_feats = None if feats is None else feats[: accepted + 1]
        acceptance.append(accepted + 1)
        drafted.append(len(draft))
        for t in draft[:accepted] + [nxt]:  # stop exactly where plain sampling would
            out.append(t)
            if len(out) >= max_new_tokens or t in eos_ids:
                break
    return DecodeResult(tokens=out[:max_new_tokens], acceptance=acceptance, drafted=drafted)
