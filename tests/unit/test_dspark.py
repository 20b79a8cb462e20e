"""DSpark (model/dspark.py, family/dspark.py) on tiny dims: a fresh one is the DFlash it wraps,
the one-pass teacher-forced forward is per-block inference with the true previous tokens, the
held-out walk's hook is the decoder's greedy chain, the loss (CE + L1 + confidence BCE), gated
drafting, sampling, and the served format both ways."""
import json

import pytest
import torch
from torch import nn

from dflash.checkpoint import export_format as fmt
from dflash.model.architectures import make_drafter
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.dspark import DSparkDrafter, previous_tokens
from dflash.model.objective import slot_labels
from helpers import check_one_pass_equals_per_block

H, V, BK, R = 64, 101, 6, 8
BASE = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
            vocab_size=V, target_layer_ids=[0, 2, 3], mask_token_id=V - 1, num_hidden_layers=2, block_size=BK)


def make(seed=0, strong=True, **over):
    """A float64 DSpark drafter; ``strong``: Markov factors large enough to change argmaxes."""
    torch.manual_seed(seed)
    d = make_drafter(DrafterConfig(**BASE, arch="dspark", markov_rank=R, **over))
    if strong:
        with torch.no_grad():
            d.markov_head.markov_w1.weight.normal_(std=1.0)
            d.markov_head.markov_w2.weight.normal_(std=1.0)
    torch.manual_seed(seed + 1)
    return d.double(), nn.Embedding(V, H).double(), nn.Linear(H, V, bias=False).double()


def context(d, feats, p):
    return d.context_kv(d.fuse(feats[:, :p]), torch.arange(p)[None])


def test_a_fresh_dspark_drafts_what_its_dflash_drafts():
    torch.manual_seed(3)
    dflash = DFlashDrafter(DrafterConfig(**BASE))
    torch.manual_seed(3)
    dspark = make_drafter(DrafterConfig(**BASE, arch="dspark", markov_rank=R, confidence_head=True))
    assert isinstance(dspark, DSparkDrafter)
    for k, v in dflash.state_dict().items():  # the backbone drawn as for a DFlash drafter of the same seed
        assert torch.equal(v, dspark.state_dict()[k]), k
    assert not dspark.markov_head.markov_w2.weight.any()  # the bias starts at zero
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    feats, p = torch.randn(1, 9, 3 * H), 9
    kv = context(dflash, feats, p)
    a = torch.tensor([7])
    assert torch.equal(dspark.draft(a, p, kv, embed, head), dflash.draft(a, p, kv, embed, head))


def test_one_pass_training_forward_is_per_block_inference_with_the_true_previous_tokens():
    d, embed, head = make()

    def block_logits(feats, ids, p):  # the chain, each slot's previous token forced to the true one
        kv = context(d, feats, p)
        return d.chain(ids[:, p], p, kv, embed, head, pick=lambda row, k: ids[:, p + k + 1])[1]

    check_one_pass_equals_per_block(d, embed, head, block_logits, hidden=H, vocab=V, block=BK, atol=1e-9)


def test_greedy_drafts_condition_each_slot_on_the_draft_before_it():
    d, embed, head = make()
    feats, p = torch.randn(1, 12, 3 * H, dtype=torch.float64), 12
    kv = context(d, feats, p)
    anchor = torch.tensor([4])
    drafts = d.draft(anchor, p, kv, embed, head)[0].tolist()
    base, _ = d.slot_logits_and_hidden(anchor, p, kv, embed, head)
    prev = 4
    for k, t in enumerate(drafts):
        bias = d.markov_head.markov_w2.weight @ d.markov_head.markov_w1.weight[prev]
        assert t == int((base[0, k] + bias).argmax())
        prev = t
    assert drafts != base[0].argmax(-1).tolist()  # the bias changed a draft: not vacuous


DRAFT_IDS = torch.tensor(sorted({*range(0, V - 1, 3), 4}))  # a draft vocabulary: every third token and the anchor


def make_dv(seed=0):
    """``make`` with a draft vocabulary of DRAFT_IDS: drafts from those tokens only (model.draft_vocab)."""
    d, embed, head = make(seed, draft_vocab_size=len(DRAFT_IDS))
    d.set_draft_vocab(DRAFT_IDS, head)
    return d, embed, head


@pytest.mark.parametrize("vocab", ["full", "draft"])
def test_the_walks_hook_is_the_decoders_greedy_chain(vocab):
    """walk_accepted reads the teacher-forced logits; decoding drafts left to right: the same
    count of accepted drafts at every anchor (exact, not up to ties: the same prefix). With a
    draft vocabulary the walk reads the served head's logits, as decoding does."""
    d, embed, head = make() if vocab == "full" else make_dv()
    S = 40
    torch.manual_seed(5)
    feats = torch.randn(1, S, 3 * H, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (1, S))
    anchors = torch.arange(1, S - BK + 1)[None]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    labels = slot_labels(ids, anchors, BK)
    # labels that follow the drafter's own greedy chain for a few slots, so acceptance is not all 0
    for j, p in enumerate(anchors[0].tolist()):
        if j % 3 == 0:
            chain = d.draft(ids[:, p], p, context(d, feats, p), embed, head)[0]
            keep = j % 5
            ids[0, p + 1:p + 1 + keep] = chain[:keep]
    labels = slot_labels(ids, anchors, BK)
    logits, hidden = d.slot_outputs(feats, ids, anchors, valid, embed, d.serving_head(head))
    ok = torch.ones_like(labels, dtype=torch.bool)
    walked = d.walk_accepted(logits, hidden, ids, anchors, labels, ok, head)[0].tolist()
    decoded = []
    for j, p in enumerate(anchors[0].tolist()):
        draft = d.draft(ids[:, p], p, context(d, feats, p), embed, head)[0].tolist()
        n = 0
        while n < len(draft) and draft[n] == ids[0, p + 1 + n]:
            n += 1
        decoded.append(n)
    assert walked == decoded
    assert max(decoded) >= 2  # some blocks accept past slot 1: the Markov chain is exercised


def test_with_a_draft_vocabulary_each_slot_drafts_from_it_biased_by_its_rows():
    """vLLM's reduced-vocabulary DSpark: markov_w1 embeds any target token, markov_w2 has a row
    per draft token, the bias is added to the draft head's logits and the pick is mapped back to
    its target id before the next slot embeds it."""
    d, embed, head = make_dv()
    assert d.markov_head.markov_w1.weight.shape == (V, R) and d.markov_head.markov_w2.weight.shape == (len(DRAFT_IDS), R)
    feats, p = torch.randn(1, 12, 3 * H, dtype=torch.float64), 12
    kv = context(d, feats, p)
    drafts = d.draft(torch.tensor([4]), p, kv, embed, head)[0].tolist()
    h = d.slot_logits_and_hidden(torch.tensor([4]), p, kv, embed, head)[1][0]
    prev, base_only = 4, []
    for k, t in enumerate(drafts):
        sub = h[k] @ head.weight[DRAFT_IDS].T + d.markov_head.markov_w2.weight @ d.markov_head.markov_w1.weight[prev]
        assert t == int(DRAFT_IDS[sub.argmax()]) and t in DRAFT_IDS.tolist()
        base_only.append(int(DRAFT_IDS[(h[k] @ head.weight[DRAFT_IDS].T).argmax()]))
        prev = t
    assert drafts != base_only  # the bias changed a draft: not vacuous
    # training's bias on a loss vocabulary's columns is the served bias on those columns; tokens
    # outside the draft vocabulary get none
    e = torch.randn(2, 3, R, dtype=torch.float64)
    rows = torch.tensor([0, 1, 2, 3, 4, 50, 51, V - 2])
    full = d.markov_bias(e)
    assert torch.allclose(d.markov_bias(e, rows), full[..., rows], atol=1e-12)
    outside = torch.tensor([i for i in range(V) if i not in DRAFT_IDS.tolist()])
    assert not full[..., outside].any() and full[..., DRAFT_IDS].any()


def test_l1_and_acceptance_of_a_dense_and_a_bucketed_target():
    from dflash.model.losses import SlotTargets, l1_per_slot, sparse_targets

    torch.manual_seed(0)
    logits, p_logits = torch.randn(3, 5, V), torch.randn(3, 5, V)
    p, q = p_logits.softmax(-1), logits.softmax(-1)
    l1, acc = l1_per_slot(logits, SlotTargets(p.log()))
    torch.testing.assert_close(l1, (p - q).abs().sum(-1))
    torch.testing.assert_close(acc, 1 - l1 / 2)
    top = p.log().topk(7, dim=-1)  # the top-7 and a tail bucket: a lower bound of the full L1
    l1k, acck = l1_per_slot(logits, sparse_targets(top.values, top.indices, None))
    assert (l1k <= l1 + 1e-6).all() and torch.allclose(acck, 1 - l1k / 2, atol=1e-6)


def test_the_loss_trains_every_head_and_reports_its_terms(tiny):
    from dflash.config import load_config
    from dflash.data import dataset as data_mod
    from dflash.model import features as Fm
    from dflash.model.build import build_drafter
    from dflash.model.losses import feature_ids
    from dflash.run.step import TrainStep

    target, tok = tiny
    cfg = load_config(None, ["model.arch=dspark", "model.markov_rank=16", "model.confidence_head=true",
                             "model.block_size=4", "train.num_anchors=5", "train.kl_topk=16",
                             "train.loss_weights=decay"])  # the decay: the metrics' own weights
    drafter = build_drafter(cfg, target, tok, [1, 2, 3])
    st = TrainStep(cfg.train, 4, drafter, target.get_input_embeddings(), target.get_output_embeddings(), "cpu")
    g = torch.Generator().manual_seed(1)
    samples = [data_mod.Sample(torch.randint(0, 400, (n,), generator=g).tolist(), [0] * 5 + [1] * (n - 5))
               for n in (30, 26, 22)]
    b = next(data_mod.batches(samples, batch_size=3, seed=0, pad_id=0))
    fids = feature_ids(cfg.train, [1, 2, 3], False, cfg.model.arch)
    assert len(fids) == 4  # DSpark's L1 reads the target's distribution: its last hidden state rides along
    feats = Fm.capture(target, b.input_ids, b.attention_mask, fids)
    losses = []
    for step in range(4):
        loss, acc = st.forward(feats, b)
        m = st.loss.metrics
        assert set(m) == {"ce", "l1", "acceptance", "confidence_bce", "confidence_error"}
        torch.testing.assert_close(loss, 0.1 * m["ce"] + 0.9 * m["l1"] + m["confidence_bce"])  # the alphas' defaults
        assert 0 < m["acceptance"] < 1 and 0 < m["confidence_error"] < 1
        st.backward(loss)
        if step == 0:
            for name in ("markov_head.markov_w2.weight", "confidence_head.proj.weight", "layers.0.q_proj.weight"):
                assert drafter.get_parameter(name).grad.abs().sum() > 0, name
        st.optimizer_step(loss)
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert drafter.markov_head.markov_w1.weight.grad is None and drafter.markov_head.markov_w2.weight.any()


def test_gated_drafting_stops_where_the_confidence_falls():
    d, embed, head = make(confidence_head=True)
    with torch.no_grad():
        d.confidence_head.proj.weight.zero_()
        d.confidence_head.proj.bias.fill_(0.0)  # 0.5 a slot: slots 1..k all accepted with 0.5^k
    feats, p = torch.randn(1, 12, 3 * H, dtype=torch.float64), 12
    kv = context(d, feats, p)
    a = torch.tensor([4])
    full = d.draft(a, p, kv, embed, head)
    assert full.shape[1] == BK - 1
    for threshold, n in ((0.3, 1), (0.2, 2), (0.1, 3), (0.6, 0)):
        gated = d.draft(a, p, kv, embed, head, threshold=threshold)
        assert gated.shape[1] == n and torch.equal(gated[0], full[0, :n]), threshold


def test_a_sampled_chain_draws_each_slot_given_the_token_drawn_before_it():
    from dflash.decode import sampling

    d, embed, head = make()
    feats, p = torch.randn(1, 10, 3 * H, dtype=torch.float64), 10
    kv = context(d, feats, p)
    a = torch.tensor([2])
    tokens, q = d.sample_chain(a, p, kv, embed, head, lambda x: sampling.probs(x, 0.8), torch.Generator().manual_seed(0))
    base, _ = d.slot_logits_and_hidden(a, p, kv, embed, head)
    prev = 2
    for k, t in enumerate(tokens.tolist()):
        bias = d.markov_head.markov_w2.weight @ d.markov_head.markov_w1.weight[prev]
        torch.testing.assert_close(q[k], sampling.probs(base[0, k] + bias, 0.8))
        prev = t


@pytest.mark.parametrize("vocab", ["full", "draft"])
def test_export_import_round_trip(tmp_path, vocab):
    from safetensors.torch import save_file

    from dflash.checkpoint import drafter_dirs

    d, _, head = make(confidence_head=True, draft_vocab_size=len(DRAFT_IDS) if vocab == "draft" else 0)
    if vocab == "draft":
        d.set_draft_vocab(DRAFT_IDS, head)
    d = d.float()
    tc = type("T", (), {"num_hidden_layers": 4, "max_position_embeddings": 512, "rope_parameters": None,
                        "rope_scaling": None})()
    cfg = fmt.export_config(d.cfg, tc, dtype="float32")
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] is False
    assert (cfg["markov_rank"], cfg["enable_confidence_head"], cfg["confidence_head_with_markov"]) == (R, True, True)
    tensors = fmt.export_state_dict(d.state_dict())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= set(tensors)
    assert tensors["confidence_head.proj.weight"].shape == (1, H + R)
    if vocab == "draft":  # vLLM's reduced-vocabulary DSpark: its own head, d2t, markov_w2 one row per draft token
        assert cfg["draft_vocab_size"] == len(DRAFT_IDS) and {"lm_head.weight", "d2t"} <= set(tensors)
        assert tensors["markov_head.markov_w2.weight"].shape == (len(DRAFT_IDS), R)
        assert tensors["markov_head.markov_w1.weight"].shape == (V, R)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    back = drafter_dirs.load(drafter_dirs.inspect(str(tmp_path)))
    assert isinstance(back, DSparkDrafter) and back.cfg.markov_rank == R and back.cfg.confidence_head
    a, b = d.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change, msg", [
    ({"sample_from_anchor": True}, "sample_from_anchor"),
    ({"markov_head_type": "rnn"}, "markov_head_type='rnn'"),
    ({"markov_rank": None}, "markov_rank=None"),
    ({"enable_confidence_head": "false"}, "enable_confidence_head='false': expected true or false"),
])
def test_a_served_config_we_cannot_run_is_one_line(change, msg):
    d, _, _ = make()
    tc = type("T", (), {"num_hidden_layers": 4, "max_position_embeddings": 512, "rope_parameters": None,
                        "rope_scaling": None})()
    raw = fmt.export_config(d.cfg, tc, dtype="float32") | change
    with pytest.raises(fmt.FormatError, match=msg):
        fmt.drafter_config_fields(raw, "x")


@pytest.mark.parametrize("sets, msg", [
    (["model.arch=dspark", "model.copy_head=true"], "model.arch=dspark with model.copy_head"),
    (["model.arch=dspark", "train.loss=kl"], "model.arch=dspark with train.loss=kl"),
    (["model.arch=dspark", "model.markov_rank=0"], "model.markov_rank=0"),
    (["model.arch=dspark", "train.dspark_ce_alpha=0", "train.dspark_tv_alpha=0"], "nothing would train the drafts"),
    (["model.target_layer_ids=[1,1,2]"], "model.target_layer_ids=[1, 1, 2]: expected distinct layer ids"),
    (["eval.confidence_threshold=0.5"], "eval.confidence_threshold=0.5"),
    (["model.arch=dspark", "eval.confidence_threshold=0.5"], "train one (model.arch=dspark, model.confidence_head"),
    (["model.arch=dspark", "model.confidence_head=true", "eval.confidence_threshold=1.5"],
     "eval.confidence_threshold=1.5"),
])
def test_bad_dspark_settings_are_one_line(sets, msg):
    import re

    from dflash.config import load_config
    from dflash.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(None, sets)


def test_a_new_draft_vocabulary_keeps_each_tokens_markov_row():
    """--init-from a DSpark export on new data: its draft vocabulary changes, and markov_w2's rows
    move with their tokens (a token new to it starts at zero) instead of staying by position."""
    d, _, head = make_dv()
    w2 = d.markov_head.markov_w2.weight.detach().clone()
    keep = DRAFT_IDS[::2].tolist()
    fresh = [t for t in range(V) if t not in DRAFT_IDS.tolist()][:len(DRAFT_IDS) - len(keep)]
    new = torch.tensor(sorted(keep + fresh))
    d.move_draft_rows(new)
    d.set_draft_vocab(new, head)
    row = {int(t): i for i, t in enumerate(DRAFT_IDS)}
    for i, t in enumerate(new.tolist()):
        want = w2[row[t]] if t in row else torch.zeros_like(w2[0])
        assert torch.equal(d.markov_head.markov_w2.weight[i], want), t


def test_eval_gates_each_drafter_that_has_a_confidence_head():
    """`dflash eval`'s threshold is each drafter's: the run's for those with a head, the flag's for
    all (a drafter without a head refuses a gate > 0 in one line)."""
    from pathlib import Path

    from dflash.checkpoint.drafter_dirs import DrafterDir
    from dflash.commands.eval import confidence_gates
    from dflash.errors import ConfigError

    with_head = DrafterDir(Path("a"), "checkpoint", {"arch": "dspark", "confidence_head": True})
    without = DrafterDir(Path("b"), "checkpoint", {"arch": "dflash"})
    other = DrafterDir(Path("c"), "checkpoint", {"arch": "dspark", "confidence_head": True})
    assert confidence_gates([with_head, without], None, [0.5, 0.5]) == [0.5, 0.0]
    assert confidence_gates([with_head, other], None, [0.9, 0.0]) == [0.9, 0.0]  # each its own run's
    for junk in ("junk", "0.5", True, float("nan"), 2):
        assert confidence_gates([with_head], None, [junk]) == [0.0], junk
    assert confidence_gates([with_head, without], 0.0, [0.5, None]) == [0.0, 0.0]
    assert confidence_gates([with_head], 0.3, [0.5]) == [0.3]
    with pytest.raises(ConfigError, match="--checkpoint 'b' has no confidence head"):
        confidence_gates([with_head, without], 0.3, [0.0, 0.0])


def test_the_feature_cache_hands_the_targets_top_k_and_the_loss_is_unchanged(tiny):
    """train.feature_cache with a loss that reads the target's distribution keeps its top-k per
    position instead of the last hidden state (model/feature_cache.py): a forward's batch and a
    cached one (and a sequence preloaded from regeneration) give the drafter features without
    FINAL and batch.kl_topk, and DSpark's loss equals the one recomputed from FINAL every step."""
    from dflash.config import load_config
    from dflash.data import dataset as data_mod
    from dflash.model import features as Fm
    from dflash.model.build import build_drafter
    from dflash.model.feature_cache import FeatureCache
    from dflash.model.losses import feature_ids
    from dflash.run.step import TrainStep

    target, tok = tiny
    cfg = load_config(None, ["model.arch=dspark", "model.markov_rank=16", "model.block_size=4",
                             "train.num_anchors=5", "train.kl_topk=16"])
    drafter = build_drafter(cfg, target, tok, [1, 2, 3])
    st = TrainStep(cfg.train, 4, drafter, target.get_input_embeddings(), target.get_output_embeddings(), "cpu")
    g = torch.Generator().manual_seed(1)
    samples = [data_mod.Sample(torch.randint(0, 400, (n,), generator=g).tolist(), [0] * 5 + [1] * (n - 5))
               for n in (30, 26, 22)]
    fids = feature_ids(cfg.train, [1, 2, 3], False, cfg.model.arch)

    def batch():
        return next(data_mod.batches(samples, batch_size=3, seed=0, pad_id=0))

    ref_b = batch()
    full = Fm.capture(target, ref_b.input_ids, ref_b.attention_mask, fids)
    with torch.no_grad():
        want = st.loss(full, ref_b)[0]  # recomputed from FINAL at the slots
    H = target.config.hidden_size
    cache = FeatureCache(fids, "cpu", target.get_output_embeddings(), 16)
    for how in ("forward", "cache"):
        b, src = batch(), {}
        got_f = Fm.target_features(target, b, fids, "cpu", cache=cache, source=src)
        assert src["features"] == how and got_f.shape[-1] == 3 * H and b.kl_topk[0].shape[-1] == 16
        with torch.no_grad():
            torch.testing.assert_close(st.loss(got_f, b)[0], want, rtol=1e-5, atol=1e-6)
    whole, chunked = cache._top(full[..., -H:]), cache._top(full[..., -H:], chunk=7)  # a chunk at a time
    torch.testing.assert_close(chunked[0], whole[0])
    assert torch.equal(chunked[1], whole[1])
    pre = FeatureCache(fids, "cpu", target.get_output_embeddings(), 16)  # regeneration's rows hold FINAL
    pre.preload({tuple(ref_b.input_ids[i, :n].tolist()): full[i, :n] for i, n in enumerate(ref_b.lengths)}, 64)
    b = batch()
    with torch.no_grad():
        torch.testing.assert_close(st.loss(pre.assemble(b), b)[0], want, rtol=1e-5, atol=1e-6)
