"""Speculative sampling at temperature > 0 is lossless in distribution: the first tokens
it generates are distributed as plain sampling from the target, and a wrong rule is caught.

The target is a Qwen3 small enough to enumerate: with top-k 3 the first three generated
tokens have at most 27 outcomes, whose exact probabilities under plain sampling come from
13 target forwards. Speculative sampling is drawn N times with seeded generators; the L1
distance between its empirical distribution and the exact one is bounded, with
probability >= 1 - 1e-4, by sqrt(K/N) + sqrt(2 ln(1e4) / N) (E|p_hat - p|_1 <= sqrt(K/N);
McDiarmid, each draw moves the L1 by at most 2/N)."""
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash.decode import sampling
from dflash.decode.spec_decode import speculative_sample
from dflash.model.drafter import DFlashDrafter, DrafterConfig

PROMPT = [3, 7, 1, 12, 5]
N, FIRST, TOP_K, TEMP = 2000, 3, 3, 1.0
DELTA = 1e-4


class PeekingDrafter(DFlashDrafter):
    """Proposes, for every slot, the target's next-token distribution after the anchor,
    flattened (logits / 4): close to p at slot 1, often wrong later. Acceptances and
    rejections both happen, so the whole rule is exercised."""

    def __init__(self, cfg, target):
        super().__init__(cfg)
        self.peek = [target]  # a list: not registered as a submodule

    copying = True  # so decoding hands draft_logits the tokens so far (context_ids)

    def draft_logits(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head, context_ids=None):
        logits = self.peek[0](context_ids).logits[0, -1] / 4
        return logits.expand(1, self.cfg.block_size - 1, -1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Thousands of tiny forwards: one thread each is ~15x faster than two contending."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair():
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                      max_position_embeddings=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        target = Qwen3ForCausalLM(cfg).eval()
        with torch.no_grad():  # spread the logits: top-3 distributions far from uniform
            target.lm_head.weight.mul_(10)
        dcfg = DrafterConfig.from_target(cfg, target_layer_ids=[1, 2], vocab_size=32, mask_token_id=31,
                                         block_size=4)
        drafter = PeekingDrafter(dcfg, target).eval()
    return target, drafter


def _exact(target, first: int) -> dict:
    """P(first `first` generated tokens) under plain sampling from the target."""
    out = {(): 1.0}
    for _ in range(first):
        nxt = {}
        for prefix, pr in out.items():
            with torch.no_grad():
                logits = target(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            p = sampling.probs(logits, TEMP, top_k=TOP_K)
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = pr * float(p[t])
        out = nxt
    return out


def _l1_of_speculative(target, drafter, exact: dict) -> tuple[float, float]:
    counts: dict = {}
    steps = []
    for seed in range(N):
        g = torch.Generator().manual_seed(seed)
        res = speculative_sample(target, drafter, PROMPT, max_new_tokens=FIRST, temperature=TEMP, top_k=TOP_K,
                                 generator=g)
        key = tuple(res.tokens)
        counts[key] = counts.get(key, 0) + 1
        steps.extend(res.acceptance)
    keys = set(counts) | set(exact)
    l1 = sum(abs(counts.get(k, 0) / N - exact.get(k, 0.0)) for k in keys)
    bound = math.sqrt(len(exact) / N) + math.sqrt(2 * math.log(1 / DELTA) / N)
    return l1, bound, sum(steps) / len(steps)


@pytest.mark.slow   # 2,000 seeded speculative decodes
def test_first_tokens_follow_the_target_distribution(pair):
    target, drafter = pair
    exact = _exact(target, FIRST)
    assert abs(sum(exact.values()) - 1) < 1e-5 and len(exact) > 8
    l1, bound, tau = _l1_of_speculative(target, drafter, exact)
    assert tau > 1.3, "drafts must be accepted sometimes, or the rule is not exercised"
    print(f"L1 {l1:.3f} < bound {bound:.3f}, tau {tau:.2f}")
    assert l1 < bound, (l1, bound)


def _resample_from_target(draft, p, q, generator=None):
    """A classic wrong rule: on rejection, sample from p instead of normalize(max(0, p - q))."""
    u = torch.rand(len(draft), generator=generator)
    for i, x in enumerate(draft):
        if u[i] * float(q[i, x]) < float(p[i, x]):
            continue
        return i, int(sampling.draw(p[i], generator))
    return len(draft), int(sampling.draw(p[len(draft)], generator))


@pytest.mark.slow   # 2,000 seeded speculative decodes
def test_a_wrong_rule_fails_the_same_bound(pair, monkeypatch):
    target, drafter = pair
    exact = _exact(target, FIRST)
    monkeypatch.setattr(sampling, "accept_block", _resample_from_target)
    l1, bound, _ = _l1_of_speculative(target, drafter, exact)
    print(f"wrong rule: L1 {l1:.3f} > bound {bound:.3f}")
    assert l1 > bound, (l1, bound)


def test_argmax_draft_is_a_point_mass():
    """q=None (argmax drafts): accept x with probability p(x), else sample p without x."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    hits = [0, 0, 0]
    g = torch.Generator().manual_seed(0)
    for _ in range(4000):
        acc, nxt = sampling.accept_block([0], p, None, g)
        hits[0 if acc == 1 else nxt] += 1
    # first token: P(0)=0.5 by acceptance; 1 and 2 by the residual, 0.3 and 0.2
    assert [round(h / 4000, 1) for h in hits] == [0.5, 0.3, 0.2]


def test_top_p_keeps_the_crossing_token():
    p = sampling.probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.7)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
