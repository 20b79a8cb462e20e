"""The frozen target: spec checks, tiny targets, hidden-state capture, mask token, SmolLM2."""

import time

import pytest
import torch

from dflash.model import target as T
from dflash.data.dataset import load_conversations, tokenize_conversation


def _batch(tok):
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello"]
    enc = tok(texts, padding=True, return_tensors="pt")  # right padding: row 1 is mostly pad
    assert enc["attention_mask"][1].sum() < enc["attention_mask"].shape[1]
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("spec", T.TINY_TARGETS)
def test_capture_matches_hf_hidden_states(spec, tok):
    model, _ = T.load_target(spec, seed=0)
    assert T.num_layers(model) == 6 and model.config.hidden_size == 256
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    ids, am = _batch(tok)
    layer_ids = [1, 2]
    feats = T.capture_hidden(model, ids, am, layer_ids)
    assert feats.shape == (2, ids.shape[1], 2 * 256)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states
    assert torch.allclose(feats[..., :256], ref[2], atol=1e-5)
    assert torch.allclose(feats[..., 256:], ref[3], atol=1e-5)
    assert not torch.allclose(ref[2], ref[3])  # the two slices really are different layers


def test_tiny_qwen35_is_hybrid():
    model, _ = T.load_target("tiny-qwen3.5")
    assert {"linear_attention", "full_attention"} <= set(model.config.layer_types)


@pytest.mark.parametrize("spec", T.TINY_TARGETS)
def test_tiny_weights_deterministic_per_seed(spec):
    a, _ = T.load_target(spec, seed=0)
    torch.manual_seed(123)  # the caller's RNG state must not matter (nor be consumed)
    before = torch.random.get_rng_state()
    b, _ = T.load_target(spec, seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)
    c, _ = T.load_target(spec, seed=1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    emb = lambda m: T.embedding(m).weight  # noqa: E731
    assert not torch.equal(emb(a), emb(c))
    assert a.get_output_embeddings().weight.data_ptr() == emb(a).data_ptr()  # tied


def test_default_layer_ids():
    assert T.default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert T.default_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert T.default_layer_ids(36, 1) == [18]
    assert T.default_layer_ids(30, 2) == [1, 27]
    assert T.default_layer_ids(4, 1) == [2]
    with pytest.raises(ValueError):
        T.default_layer_ids(36, 0)
    with pytest.raises(ValueError):
        T.default_layer_ids(2, 2)  # would need layer -1


def test_capture_rejects_bad_layers(tok):
    model, _ = T.load_target("tiny-llama")
    ids, am = _batch(tok)
    with pytest.raises(ValueError):
        T.capture_hidden(model, ids, am, [6])


def test_check_target_spec(tmp_path, monkeypatch):
    for ok in ("smollm2", *T.TINY_TARGETS):
        T.check_target_spec(ok)
    with pytest.raises(T.TargetSpecError, match=r"target './nope': no such model directory \(expected smollm2"):
        T.check_target_spec("./nope")
    with pytest.raises(T.TargetSpecError, match="no config.json"):
        T.check_target_spec(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    T.check_target_spec(str(tmp_path))
    with pytest.raises(T.TargetSpecError, match="'tiny-gpt'"):
        T.check_target_spec("tiny-gpt")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    T.check_target_spec("Qwen/Qwen3-8B")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants
    cache = tmp_path / "hub"
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(T.TargetSpecError, match="HF_HUB_OFFLINE"):
        T.check_target_spec("Qwen/Qwen3-8B")
    snap = cache / "models--Qwen--Qwen3-8B" / "snapshots" / "abc"  # downloaded before: offline is fine
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (cache / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("abc")
    T.check_target_spec("Qwen/Qwen3-8B")
    assert "\n" not in str(pytest.raises(T.TargetSpecError, T.check_target_spec, "/x/y/z").value)


def test_mask_token_never_produced(tok):
    mid, why = T.choose_mask_token_id(tok, 49152)
    assert mid == 16 and "<empty_output>" in why
    assert mid not in tok.all_special_ids
    for conv in load_conversations(limit=300, seed=0):  # chat-templated real text never yields it
        assert mid not in tokenize_conversation(tok, conv, 10**6).input_ids
    # Padding rows win over special tokens; a real mask token wins over both.
    assert T.choose_mask_token_id(tok, 49160)[0] == 49152

    class WithMask:
        mask_token_id, mask_token = 7, "<mask>"

    assert T.choose_mask_token_id(WithMask(), 10)[0] == 7


@pytest.mark.slow
def test_smollm2_loads_and_answers():
    t0 = time.perf_counter()
    model, tok = T.load_target("smollm2")  # first run: dequantize + cache; later: cached dir
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tok = T.load_target("smollm2")
    cached = time.perf_counter() - t0
    assert cached < 10, f"cached load took {cached:.1f}s (first {first:.1f}s)"
    assert T.num_layers(model) == 30 and T.choose_mask_token_id(tok, T.embedding(model).num_embeddings)[0] == 16
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.parametrize("spec", T.TINY_TARGETS)
def test_capture_stops_after_the_deepest_layer_with_the_same_features(spec, tok):
    """features.capture (the training path) equals capture_hidden bit for bit, the final norm's
    output included (KL's FINAL), and no layer after the deepest selected one runs."""
    from dflash.model import features as Fm

    model, _ = T.load_target(spec, seed=0)
    ids, am = _batch(tok)
    ran = []
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: ran.append(k))
             for k, layer in enumerate(Fm.decoder_layers(model))]
    try:
        for layer_ids in ([1, 3, 2], [1, 1, 2], [0, T.FINAL]):
            ran.clear()
            got = Fm.capture(model, ids, am, layer_ids)
            deepest = T.num_layers(model) - 1 if T.FINAL in layer_ids else max(layer_ids)
            assert ran == list(range(deepest + 1)), (layer_ids, ran)
            assert torch.equal(got, T.capture_hidden(model, ids, am, layer_ids)), layer_ids
        # a layer whose hidden_states entry is the final norm's output: the plain forward
        last = [T.num_layers(model) - 1]
        assert torch.equal(Fm.capture(model, ids, am, last), T.capture_hidden(model, ids, am, last))
    finally:
        for h in hooks:
            h.remove()


def test_capture_is_per_thread_on_a_shared_model(tiny, tok):
    """Target workers on one device share the model: each thread's capture keeps its own layers."""
    import threading

    from dflash.model import features as Fm

    model, _ = tiny
    ids, am = _batch(tok)
    want = {ids_: T.capture_hidden(model, ids, am, list(ids_)) for ids_ in ((1, 2), (3,))}
    errors, barrier = [], threading.Barrier(2)

    def work(layer_ids):
        barrier.wait()
        for _ in range(5):
            if not torch.equal(Fm.capture(model, ids, am, list(layer_ids)), want[layer_ids]):
                errors.append(layer_ids)

    threads = [threading.Thread(target=work, args=(k,)) for k in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
