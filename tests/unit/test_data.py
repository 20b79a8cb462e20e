"""ShareGPT loading, chat templating + loss mask, splits, batches, regeneration."""

import json
import time

import pytest
import torch

from dflash.data import dataset as D
from dflash.prep.regenerate import regenerate
from dflash.model import target as T

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello, then say hello again."},
    {"role": "assistant", "content": "hello"},  # also appears in the user turn: must not match there
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "One, two, three.\nDone."},
]


pytestmark = pytest.mark.usefixtures("tmp_cache")   # tok, tmp_cache: tests/conftest.py


def _masked(tok, s, value=1):
    return tok.decode([i for i, m in zip(s.input_ids, s.loss_mask) if m == value])


def test_loss_mask_covers_exactly_the_assistant_turns(tok):
    s = D.tokenize_conversation(tok, CONV, max_len=10_000)
    assert s.input_ids == list(tok.apply_chat_template(CONV, tokenize=True)["input_ids"])
    assert _masked(tok, s) == "hello<|im_end|>One, two, three.\nDone.<|im_end|>"
    rest = _masked(tok, s, 0)
    assert "Say hello, then say hello again." in rest and "Done" not in rest and "Be brief." in rest
    # Turn texts that also occur in text the template injects (SmolLM2's default system prompt
    # "... named SmolLM, trained by Hugging Face") must not be matched there.
    echo = [{"role": "user", "content": "SmolLM"}, {"role": "assistant", "content": "Hugging Face"}]
    assert _masked(tok, D.tokenize_conversation(tok, echo, max_len=10_000)) == "Hugging Face<|im_end|>"


def test_loss_mask_on_real_sharegpt(tok):
    convs = D.load_conversations(limit=40, seed=0)
    for conv in convs:
        s = D.tokenize_conversation(tok, conv, max_len=10**6)
        want = "".join(m["content"].strip() + "<|im_end|>" for m in conv if m["role"] == "assistant")
        assert _masked(tok, s) == want


def test_truncation_and_min_loss_tokens(tok):
    full = D.tokenize_conversation(tok, CONV, max_len=10_000)
    s = D.tokenize_conversation(tok, CONV, max_len=30)
    assert s.input_ids == full.input_ids[:30] and s.loss_mask == full.loss_mask[:30]
    n_loss = sum(full.loss_mask)
    assert len(D.build_samples(tok, [CONV], max_len=10_000, min_loss_tokens=n_loss)) == 1
    assert D.build_samples(tok, [CONV], max_len=10_000, min_loss_tokens=n_loss + 1) == []
    assert D.build_samples(tok, [CONV], max_len=30, min_loss_tokens=n_loss) == []  # cut by max_len


def test_long_samples_split_into_windows_that_keep_every_token(tok):
    """data.long_samples=split: consecutive max_len windows, nothing lost or repeated; a window
    with too few loss tokens is dropped (counted) like a cut sample."""
    full = D.tokenize_conversation(tok, CONV, max_len=10_000)
    counts = {}
    wins = D.build_samples(tok, [CONV], max_len=16, min_loss_tokens=0, counts=counts, long="split")
    assert len(wins) == -(-len(full) // 16) and all(len(w) <= 16 for w in wins)
    assert [i for w in wins for i in w.input_ids] == full.input_ids
    assert [m for w in wins for m in w.loss_mask] == full.loss_mask
    assert counts["over_length"] == 1 and "split into windows" in D.data_report(counts, max_len=16, samples=len(wins))
    kept = D.build_samples(tok, [CONV], max_len=16, min_loss_tokens=2, long="split")
    assert kept == [w for w in wins if w.loss_tokens >= 2] and len(kept) < len(wins)
    assert D.build_samples(tok, [CONV], max_len=16, min_loss_tokens=2) == \
        [w for w in wins[:1] if w.loss_tokens >= 2]  # cut: the first window only
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    other = D.build_samples(tok, [short], max_len=16, min_loss_tokens=0, long="split")
    assert len(other) != len(wins)
    per_conv = [wins, other, wins]
    rounds = [w[k] for k in range(max(map(len, per_conv))) for w in per_conv if k < len(w)]
    assert D.build_samples(tok, [CONV, short, CONV], max_len=16, min_loss_tokens=0, long="split") == rounds


def test_max_samples_keeps_the_first_prepared_samples():
    from dflash.prep.prepare import first_samples
    xs = list(range(10))
    assert first_samples(xs, 0) == xs and first_samples(xs, 20) == xs and first_samples(xs, 3) == [0, 1, 2]


def test_split_heldout_deterministic_disjoint():
    items = list(range(1000))
    train, ev = D.split_heldout(items, eval_fraction=0.05, seed=3)
    assert len(ev) == 50 and sorted(train + ev) == items and not set(train) & set(ev)
    assert (train, ev) == D.split_heldout(items, eval_fraction=0.05, seed=3)
    assert ev != D.split_heldout(items, eval_fraction=0.05, seed=4)[1]
    assert len(D.split_heldout(items[:40], seed=0)[1]) == 8  # min_eval
    assert len(D.split_heldout(items[:6], seed=0)[1]) == 3  # never more than half


def test_split_keeps_repeats_of_held_out_prompts_out_of_training():
    from dflash.data.prompt_sets import user_turn_keys

    def conv(text, reply="ok"):
        return [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]

    long = "Translate the following text into French, keeping the tone: " * 5  # > 200 characters
    items = [conv(f"question {i}") for i in range(40)]
    # repeats: the same prompt with other spacing, case and punctuation, the same long template
    # with another tail, and one as a later user turn; an unrelated conversation stays
    items += [conv("HELLO, there!", "other reply"), conv(long + "second text"),
              conv("x") + conv("Hello there"), conv("Hello there, friend")]
    _, ev0 = D.split_heldout(items, seed=2)
    held = [items.index(c) for c in ev0]
    assert not set(held) & {40, 41, 42, 43}, "pick another seed: a repeat itself was held out"
    items[held[0]], items[held[1]] = conv("  Hello   there "), conv(long + "first text")
    counts = {}
    train, ev = D.split_heldout(items, seed=2, key=user_turn_keys, counts=counts)
    assert len(ev) == 8 and counts == {"held_out_repeats": 3}
    line = D.data_report(counts | {"conversations": 44, "held_out": 8}, max_len=64, samples=len(train))
    assert line.count("3 repeating a held-out prompt left out of training") == 1, line
    assert conv("Hello there, friend") in train and not any(set(user_turn_keys(t)) & set().union(
        *map(user_turn_keys, ev)) for t in train)
    # without a key, the split is the plain one (the held-out indices do not depend on the key)
    assert [items.index(c) for c in D.split_heldout(items, seed=2)[1]] == [items.index(c) for c in ev]

def _samples():
    return [D.Sample(list(range(1, n + 1)), [0] * (n // 2) + [1] * (n - n // 2)) for n in range(3, 40)]


def test_batches_shapes_padding_determinism():
    samples = _samples()
    take = lambda it, k: [next(it) for _ in range(k)]  # noqa: E731
    a = take(D.batches(samples, batch_size=4, seed=0, pad_id=-1), 20)
    b = take(D.batches(samples, batch_size=4, seed=0, pad_id=-1), 20)
    c = take(D.batches(samples, batch_size=4, seed=1, pad_id=-1), 20)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert not all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, c))
    assert [x.index for x in a] == list(range(20))
    for x in a:
        ids, am, lm = x.input_ids, x.attention_mask, x.loss_mask
        assert ids.dtype == am.dtype == lm.dtype == torch.long and ids.shape == am.shape == lm.shape
        assert ids.shape[0] == 4 and ids.shape[1] == int(am.sum(1).max())  # padded to the batch max only
        assert bool((ids[am == 0] == -1).all()) and bool((lm[am == 0] == 0).all())
        assert bool((am[:, 0] == 1).all())  # right padding
    # One epoch = 9 batches of 4 distinct samples (37 samples, remainder dropped).
    lengths = [int(n) for x in a[:9] for n in x.attention_mask.sum(1)]
    assert len(set(lengths)) == 36
    # Bucketing: far less padding than random batches.
    pad = lambda bs: sum(int((x.attention_mask == 0).sum()) for x in bs)  # noqa: E731
    assert pad(a[:9]) < pad(take(D.batches(samples, batch_size=4, seed=0, pad_id=-1, bucket=False), 9)) / 2
    # start= skips batches exactly (resume).
    resumed = next(D.batches(samples, batch_size=4, seed=0, pad_id=-1, start=13))
    assert resumed.index == 13 and torch.equal(resumed.input_ids, a[13].input_ids)


def _write_sharegpt(path, records, cut=0):
    text = json.dumps(records, indent=1)
    path.write_text(text[: len(text) - cut] if cut else text)
    return path


RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"id": "b", "conversations": []},  # empty
    {"id": "c", "conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},  # role
    {"id": "d", "conversations": [{"from": "gpt", "value": "stray"}, {"from": "human", "value": "q"},
                                  {"from": "gpt", "value": "a"}, {"from": "human", "value": "dangling"}]},
    {"id": "e", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q2"},
                                  {"from": "chatgpt", "value": "a2"}]},
    {"id": "f"},  # no conversations
    {"id": "g", "conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}]},
    {"id": "h", "conversations": [{"from": "human", "value": "last"}, {"from": "gpt", "value": "one"}]},
]


def test_load_conversations_small_file(tmp_path):
    path = _write_sharegpt(tmp_path / "sg.json", RECORDS)
    convs = D.load_conversations(path, limit=10, seed=0)
    assert len(convs) == 4
    assert [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}] in convs
    assert [{"role": "system", "content": "sys"}, {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"}] in convs
    assert D.load_conversations(path, limit=10, seed=0) == convs  # deterministic (and cached)
    assert sorted(map(str, D.load_conversations(path, limit=10, seed=1))) == sorted(map(str, convs))
    assert len(D.load_conversations(path, limit=2, seed=0)) == 2
    # A file cut in the middle of its last record still yields the complete ones before it.
    cut = _write_sharegpt(tmp_path / "cut.json", RECORDS, cut=40)
    assert len(D.load_conversations(cut, limit=10, seed=0)) == 3


def test_dataset_errors(tmp_path):
    with pytest.raises(D.DatasetError, match="nope.json': no such file"):
        D.check_dataset_path(tmp_path / "nope.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("this is not json")
    with pytest.raises(D.DatasetError, match="garbage.json"):
        D.check_dataset_path(garbage)
    with pytest.raises(D.DatasetError, match="garbage.json"):
        D.load_conversations(garbage, limit=5)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"conversations": [}')
    with pytest.raises(D.DatasetError, match="broken.json"):
        D.load_conversations(broken, limit=5)
    with pytest.raises(D.DatasetError, match="no usable conversation in 2 records .dropped: "):
        D.load_conversations(_write_sharegpt(tmp_path / "bad.json", RECORDS[1:3]), limit=5)
    D.check_dataset_path(D.sharegpt_path())


def test_load_real_sharegpt():
    t0 = time.perf_counter()
    convs = D.load_conversations(limit=50, seed=0)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = D.load_conversations(limit=50, seed=0)
    assert again == convs and len(convs) == 50
    assert time.perf_counter() - t0 < first  # served from the cached subset
    for conv in convs:
        roles = [m["role"] for m in conv if m["role"] != "system"]
        assert roles[0] == "user" and roles[-1] == "assistant" and all(m["content"].strip() for m in conv)
    assert D.load_conversations(limit=50, seed=1) != convs


def test_prompts_for_eval(tok):
    long = [{"role": "user", "content": "word " * 1000}, {"role": "assistant", "content": "ok"}]
    short, cut = D.prompts_for_eval(tok, [CONV, long], max_prompt_len=64)
    assert tok.decode(short).endswith("<|im_start|>user\nSay hello, then say hello again.<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    assert len(cut) <= 64 and tok.decode(cut).endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow   # real generation with the tiny targets
def test_regenerate_matches_unbatched_greedy(tiny):
    model, tok = tiny
    convs = [CONV, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}],
             [{"role": "user", "content": "Tell me a long story about a dragon. " * 4},
              {"role": "assistant", "content": "y"}]]
    out = regenerate(model, tok, convs, max_new_tokens=12, batch_size=3)
    assert [m["role"] for m in out[0]] == ["system", "user", "assistant"]
    assert [m["role"] for m in out[1]] == ["user", "assistant"]
    prompts = D.prompts_for_eval(tok, convs, max_prompt_len=256)
    for conv, prompt in zip(out, prompts):
        # The shorter prompts were left padded in the batch: greedy output must not change.
        single = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        want = single[: single.index(tok.eos_token_id) + 1] if tok.eos_token_id in single else single
        gen = conv[-1]["token_ids"]
        assert gen == want
        assert conv[-1]["content"] == tok.decode(gen, skip_special_tokens=True)
        s = D.tokenize_conversation(tok, conv, max_len=10_000)
        assert s.input_ids == prompt + gen and s.loss_mask == [0] * len(prompt) + [1] * len(gen)


@pytest.mark.slow   # real generation with the tiny targets
@pytest.mark.parametrize("target,use_cache", [("tiny-qwen3", True), ("tiny-llama", True), ("tiny-llama", False)])
def test_regenerate_keeps_the_features_a_forward_gives(target, use_cache):
    """Regeneration's captured layers (prefill + decoding steps, left padded, KV cached) are the
    teacher-forced forward's features for the same sequence; only the last token's row is zero.
    A checkpoint whose generation config turns the KV cache off gets it on for regeneration."""
    model, tok = T.load_target(target)
    model.generation_config.use_cache = use_cache
    layer_ids = T.default_layer_ids(T.num_layers(model), 3)
    convs = [CONV, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}],
             [{"role": "user", "content": "Tell me a long story about a dragon. " * 4},
              {"role": "assistant", "content": "y"}]]
    feats: dict = {}
    out = regenerate(model, tok, convs, max_new_tokens=12, batch_size=3, layer_ids=layer_ids, features=feats)
    assert len(feats) == len(convs)
    for conv in out:
        s = D.tokenize_conversation(tok, conv, max_len=10_000)
        got = feats[tuple(s.input_ids)]
        ids = torch.tensor([s.input_ids])
        want = T.capture_hidden(model, ids, torch.ones_like(ids), layer_ids)[0]
        assert got.shape == want.shape
        last = len(s.input_ids) - 1
        torch.testing.assert_close(got[:last], want[:last], atol=2e-4, rtol=1e-3)
        assert torch.count_nonzero(got[last]) == 0 or torch.allclose(got[last], want[last], atol=2e-4, rtol=1e-3)
