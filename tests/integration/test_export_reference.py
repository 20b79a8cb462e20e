"""The served DFlash format, checked against z-lab's reference code (PyPI dflash 0.1.0).

- our export, read by the reference: no missing and no unexpected weights, and its decode
  accepts step for step what our eval accepted (fp32, greedy; only the last step may
  differ: the reference shortens its last block to the tokens left, we do not), with
  equal outputs;
- the round trip: our eval of the export equals our eval of the checkpoint it came from;
- the reference's own drafter (random init, save_pretrained), read by our eval, scores
  the acceptance lengths of the reference's own decode.
"""
import json

import pytest
import torch

import reference_dflash
from helpers import last_json, run_dflash

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # many tiny forwards: two threads on a shared 2-core host crawl


@pytest.fixture(scope="module")
def ref():
    mod, why = reference_dflash.load()
    if mod is None:
        pytest.skip(f"z-lab reference dflash=={reference_dflash.VERSION} unavailable: {why}")
    return mod


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """conftest's trained run (tiny-qwen3, 40 steps), its fp32 export, and one eval of both side by side."""
    run = trained
    exp = tmp_path_factory.mktemp("export") / "export-fp32"
    p = run_dflash("export", "--checkpoint", run / "checkpoint", "--out", exp, "--dtype", "float32")
    assert "num_speculative_tokens = 7" in p.stdout
    p = run_dflash("eval", "--checkpoint", run / "checkpoint", "--checkpoint", exp, "--prompts", 3,
                   "--max-new-tokens", 24, "--json", env=ONE_THREAD)
    return run, exp, last_json(p.stdout)["drafters"], p.stdout


def test_export_files_and_config(exported):
    run, exp, _, _ = exported
    cfg = json.loads((exp / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    flags = cfg["dflash_config"]
    assert flags["block_size"] == cfg["block_size"] == 8
    assert flags["num_target_layers"] == cfg["num_target_layers"] == 6
    assert flags["target_layer_ids"] == [1, 2, 3] and "mask_token_id" in flags
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is False and cfg["dtype"] == "float32"
    from safetensors import safe_open
    with safe_open(str(exp / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.input_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    readme = (exp / "README.md").read_text()
    assert "--speculative-algorithm DFLASH" in readme and '"num_speculative_tokens": 7' in readme
    # the run itself left a servable export (bf16) at its end
    s = json.loads((run / "summary.json").read_text())
    assert s["export"]["dtype"] == "bfloat16" and (run / "export" / "model.safetensors").is_file()


def test_round_trip_and_side_by_side_table(exported):
    _, exp, (ours, served), stdout = exported
    assert ours["format"] == "checkpoint" and served["format"] == "export"
    assert ours["per_prompt_steps"] == served["per_prompt_steps"]  # fp32: identical steps and outputs
    assert ours["lossless"] and served["lossless"]
    assert "side by side on tiny-qwen3" in stdout and str(exp) in stdout and "tok/s" in stdout


def _reference_steps(ref, model, target, steps, stop_ids, max_new):
    out = []
    for s in steps:
        r = ref.dflash_generate(model, target, torch.tensor([s["prompt_ids"]]), max_new_tokens=max_new,
                                stop_token_ids=stop_ids, return_stats=True)
        out.append((r.acceptance_lengths, r.output_ids[0, len(s["prompt_ids"]):].tolist()))
    return out


def _drafts_ours(drafter, target, steps, res):
    """Every block our decode drafted, per prompt."""
    from dflash.decode.spec_decode import speculative_generate

    out, seen = [], []
    plain = drafter.draft
    drafter.draft = lambda *a, **k: seen.append(plain(*a, **k)[0].tolist()) or torch.tensor([seen[-1]])
    for s in steps:
        seen = []
        speculative_generate(target, drafter, s["prompt_ids"], max_new_tokens=res["max_new_tokens"],
                             eos_ids=set(res["stop_token_ids"]))
        out.append(seen)
    return out


def _drafts_ref(ref, model, target, steps, res):
    out, seen = [], []
    plain = model.compute_logits

    def recording(hidden, head):
        logits = plain(hidden, head)
        seen.append(logits.argmax(-1)[0].tolist())
        return logits
    model.compute_logits = recording
    try:
        for s in steps:
            seen = []
            ref.dflash_generate(model, target, torch.tensor([s["prompt_ids"]]), max_new_tokens=res["max_new_tokens"],
                                stop_token_ids=res["stop_token_ids"])
            out.append(seen)
    finally:
        del model.compute_logits
    return out


def _same_drafts(ours, theirs):
    for a, b in zip(ours, theirs):
        full = [i for i, d in enumerate(b) if len(d) == len(a[0])]  # the reference shortens its last blocks
        assert [a[i] for i in full] == [b[i] for i in full]
        assert full and len(full) >= len(a) - len(a[0])  # only the last few blocks are short


@pytest.mark.network   # z-lab's wheel from the package index (the ref fixture)
def test_reference_drafts_what_we_draft(ref, exported, tiny, tmp_path):
    """The trained drafter of a repetitive tiny target drafts one token everywhere; a random
    drafter with a strong context path drafts a different token at every slot, so a wrong
    name, layer id or rotary setting in the export changes its drafts."""
    from dflash.checkpoint.export import write_export
    from dflash.model.drafter import DFlashDrafter

    run, _, (_, served), _ = exported
    cfg = json.loads((run / "checkpoint" / "config.json").read_text())
    from dflash.model.drafter import DrafterConfig
    torch.manual_seed(3)
    ours = DFlashDrafter(DrafterConfig.from_dict(cfg)).eval()
    with torch.no_grad():
        ours.fc.weight.mul_(20)
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    target, _ = tiny
    write_export(ours, target.config, tmp_path / "x", dtype="float32", target="tiny-qwen3")
    model = ref.DFlashDraftModel.from_pretrained(str(tmp_path / "x"), dtype=torch.float32).eval()
    steps = served["per_prompt_steps"][:2]
    mine, theirs = _drafts_ours(ours, target, steps, served), _drafts_ref(ref, model, target, steps, served)
    assert len({t for blocks in mine for b in blocks for t in b}) > 3  # lively drafts, not one token
    _same_drafts(mine, theirs)


@pytest.mark.network   # z-lab's wheel from the package index (the ref fixture)
def test_reference_reads_our_export_and_accepts_step_for_step(ref, exported, tiny):
    run, exp, (_, served), _ = exported
    model, info = ref.DFlashDraftModel.from_pretrained(str(exp), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    target, _ = tiny
    steps = served["per_prompt_steps"]
    agreed, total, ref_taus = 0, 0, []
    for s, (acc, out) in zip(steps, _reference_steps(ref, model.eval(), target, steps, served["stop_token_ids"],
                                                        served["max_new_tokens"])):
        assert acc[:-1] == s["acceptance_lengths"][:-1], (acc, s["acceptance_lengths"])
        assert out == s["output_ids"]
        agreed += len(acc) - 1 + (acc[-1] == s["acceptance_lengths"][-1])
        total += max(len(acc), len(s["acceptance_lengths"]))
        ref_taus.append(sum(acc) / len(acc))
    assert total > 3 and served["acceptance_length"] > 1
    # a repetitive tiny target lets different drafters accept alike: compare every draft too
    from dflash.checkpoint import checkpoint as ckpt
    _same_drafts(_drafts_ours(ckpt.load_drafter(run / "checkpoint")[0].eval(), target, steps, served),
                 _drafts_ref(ref, model, target, steps, served))
    print(f"\nreference: {agreed}/{total} verify steps agreed; tau ours {served['acceptance_length']:.4f}, "
          f"reference {sum(ref_taus) / len(ref_taus):.4f} ({len(steps)} prompts)")


@pytest.mark.network   # z-lab's wheel from the package index (the ref fixture)
def test_our_eval_reads_a_reference_drafter(ref, tiny, tmp_path):
    from transformers import Qwen3Config

    target, _ = tiny
    tc = target.config
    cfg = Qwen3Config(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                      num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
                      intermediate_size=tc.intermediate_size, num_hidden_layers=2, vocab_size=tc.vocab_size,
                      max_position_embeddings=tc.max_position_embeddings, tie_word_embeddings=False,
                      architectures=["DFlashDraftModel"], num_target_layers=tc.num_hidden_layers,
                      block_size=4, dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 16,
                                                   "block_size": 4, "num_target_layers": tc.num_hidden_layers})
    torch.manual_seed(0)
    model = ref.DFlashDraftModel(cfg).eval()
    with torch.no_grad():  # a random drafter that sometimes agrees: its fc reads the last layer strongly
        model.fc.weight.mul_(20)
    model.save_pretrained(tmp_path / "ref-drafter")
    res = last_json(run_dflash("eval", "--checkpoint", tmp_path / "ref-drafter", "--target", "tiny-qwen3",
                               "--prompts", 2, "--max-new-tokens", 20, "--json", "--no-lossless-check",
                               env=ONE_THREAD).stdout)
    assert res["format"] == "export" and res["block_size"] == 4
    steps = res["per_prompt_steps"]
    for s, (acc, out) in zip(steps, _reference_steps(ref, model, target, steps, res["stop_token_ids"],
                                                        res["max_new_tokens"])):
        assert acc[:-1] == s["acceptance_lengths"][:-1], (acc, s["acceptance_lengths"])
        assert out == s["output_ids"]
    # and block by block, what our loader made of its weights drafts what it drafts
    from dflash.checkpoint import drafter_dirs
    ours = drafter_dirs.load(drafter_dirs.inspect(tmp_path / "ref-drafter")).eval()
    _same_drafts(_drafts_ours(ours, target, steps, res), _drafts_ref(ref, model, target, steps, res))


def test_a_drafter_that_does_not_fit_the_target_is_one_line(exported, tmp_path):
    _, exp, _, _ = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((exp / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 2, 9]
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((exp / "model.safetensors").read_bytes())
    p = run_dflash("eval", "--checkpoint", bad, "--target", "tiny-qwen3", check=False)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "target_layer_ids" in p.stderr and "6 decoder layers" in p.stderr


@pytest.mark.network   # z-lab's wheel from the package index (the ref fixture)
def test_reference_forward_equals_ours_on_one_block(ref, exported, tiny):
    """Below the decode: the same context and block give the same drafter hidden states
    (a wrong name, layer id or rotary setting shows here even where greedy tokens agree)."""
    from dflash.checkpoint import checkpoint as ckpt

    run, exp, _, _ = exported
    model = ref.DFlashDraftModel.from_pretrained(str(exp), dtype=torch.float32).eval()
    ours, _ = ckpt.load_drafter(run / "checkpoint")
    target, _ = tiny
    ids = torch.arange(100, 140)[None]
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = ref.extract_context_feature(hs, model.target_layer_ids)
        n, B = ids.shape[1], ours.cfg.block_size
        block = torch.full((1, B), ours.cfg.mask_token_id)
        block[0, 0] = 7
        emb = target.get_input_embeddings()(block)
        theirs = model(position_ids=torch.arange(n + B)[None], noise_embedding=emb, target_hidden=feats)
        kv = ours.context_from_features(feats, torch.arange(n)[None], target.get_input_embeddings())
        mine = ours.blocks_hidden(emb, torch.arange(n, n + B)[None], kv, None)
    assert model.target_layer_ids == ours.cfg.target_layer_ids
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
