"""Training end to end on a tiny target: resume is exact, the pipeline equals the
reference loop, a trained drafter beats the untrained one on tau, bf16 on the CPU, and
the best step by the held-out estimate is kept."""
import json

import pytest

from helpers import TINY, last_json, run_dflash


def _summary(run):
    return json.loads((run / "summary.json").read_text())


# the feature cache with the target's top-k (a KL loss): 6 steps over 3 batches an epoch, resumed at
# step 3, where the uninterrupted run's cache serves what the resumed one forwards (its cache is new)
CACHED = ["--set", "data.num_conversations=8", "--set", "train.feature_cache=true", "--set", "train.loss=kl",
          "--set", "train.kl_topk=8"]


@pytest.mark.parametrize("extra", [[], CACHED], ids=["plain", "feature-cache-top-k"])
def test_resume_continues_bit_for_bit(tmp_path, extra):
    full, part = tmp_path / "full", tmp_path / "part"
    run_dflash("train", "--out", full, "--target", "tiny-qwen3", "--steps", 6, "--no-telemetry", *TINY, *extra)
    run_dflash("train", "--out", part, "--target", "tiny-qwen3", "--steps", 6, "--no-telemetry", *TINY, *extra,
               "--set", "train.stop_after=3")
    assert _summary(part)["steps"] == 3
    ck = part / "checkpoint"
    assert {"config.json", "model.safetensors", "training_state.safetensors", "training_state.json"} <= \
        {f.name for f in ck.iterdir()}
    run_dflash("train", "--out", part, "--target", "tiny-qwen3", "--steps", 6, "--no-telemetry", *TINY, *extra,
               "--resume")
    a, b = _summary(full)["loss_history"], _summary(part)["loss_history"]
    assert [s for s, _ in b] == list(range(6))
    assert a == b, "resumed run must follow the uninterrupted loss trajectory exactly"


def test_pipelined_matches_reference_loop(tmp_path):
    ref, pipe = tmp_path / "ref", tmp_path / "pipe"
    run_dflash("train", "--out", ref, "--target", "tiny-llama", "--steps", 5, "--no-telemetry", "--reference", *TINY)
    run_dflash("train", "--out", pipe, "--target", "tiny-llama", "--steps", 5, "--no-telemetry", *TINY,
               "--set", "pipeline.queue_size=2", "--set", "pipeline.min_ready=2")
    a, b = _summary(ref), _summary(pipe)
    assert b["pipelined"] and not a["pipelined"]
    assert a["loss_history"] == b["loss_history"]
    assert a["tokens"] == b["tokens"]


@pytest.mark.slow
def test_training_raises_tau_well_above_untrained(tmp_path):
    # one process: the eval before training (the untrained drafter), 120 steps, the eval after
    trained = tmp_path / "trained"
    run_dflash("train", "--out", trained, "--target", "tiny-qwen3", "--steps", 120, "--no-telemetry", *TINY,
               "--set", "train.estimate_every=40", "--eval")
    s = _summary(trained)
    before, after = s["eval_before"], s["eval_after"]
    assert {"acceptance_length", "block_size", "prompts", "histogram", "lossless"} <= set(before)
    # the learning curve: the held-out tau walked per verify step at steps 0, 40, 80, 120, and its picture
    est = s["acceptance_estimate"]
    assert [step for step, _ in est["history"]] == [0, 40, 80, 120]
    # per verify step (the estimate's convention): a tiny target's replies repeat, so most steps
    # still accept nothing and a long accepted run counts once; the per-prompt mean below moves more
    assert est["history"][0][1] < 1.5 and est["history"][-1][1] > est["history"][0][1] + 0.2, est
    assert len(est["last"]["per_position_acceptance"]) == 7 and est["held_out_sequences"] == 4
    assert (trained / "learning_curve.png").stat().st_size > 10_000
    assert s["loss_last"] < s["loss_first"]
    assert before["lossless"] and after["lossless"]
    assert before["acceptance_length"] < 1.5
    assert after["acceptance_length"] > before["acceptance_length"] + 1.0, (before, after)  # per-prompt mean
    assert after["tau_per_step"] > before["tau_per_step"] + 0.2, (before, after)
    assert sum(after["histogram"].values()) > 0 and after["block_size"] == 8


def test_a_copy_head_drafter_trains_estimates_both_ways_and_decodes_losslessly(tmp_path):
    # model.copy_head end to end: the estimate reports the drafter with and without its copy
    # proposals, the summary table says both, and eval (with or without them) stays lossless
    p = run_dflash("train", "--out", tmp_path, "--target", "tiny-qwen3", "--steps", 6, "--no-telemetry", *TINY,
                   "--set", "model.copy_head=true", "--set", "train.estimate_every=3")
    est = _summary(tmp_path)["acceptance_estimate"]
    assert [s for s, _ in est["history_no_copy"]] == [s for s, _ in est["history"]] == [0, 3, 6]
    assert "tau_no_copy" in est["last"] and "without the copy head" in p.stderr
    assert (tmp_path / "learning_curve.png").stat().st_size > 10_000
    runs = {}
    for flag in ([], ["--no-copy-head"]):
        runs[bool(flag)] = last_json(run_dflash("eval", "--checkpoint", tmp_path / "checkpoint", "--prompts", 2,
                                                "--max-new-tokens", 12, "--json", *flag).stdout)
    assert runs[False]["copy_head"] is True and runs[True]["copy_head"] is False
    assert runs[False]["lossless"] and runs[True]["lossless"]
    assert len(runs[False]["per_prompt"]) == 2  # eval's per-prompt spread


def test_eval_before_off_measures_only_after_training(tmp_path):
    # the demo's setting: the untrained drafter's tau (1.0) is the curve's step 0, not a decode
    args = ["train", "--out", tmp_path / "run", "--target", "tiny-qwen3", "--steps", 2, "--no-telemetry", *TINY,
            "--set", "eval.prompts=1", "--set", "eval.max_new_tokens=8", "--set", "eval.before=false",
            "--set", "train.estimate_every=2", "--set", "train.estimate_samples=1", "--eval"]
    cache = {"DFLASH_CACHE": str(tmp_path / "cache")}
    p = run_dflash(*args, env=cache)
    s = _summary(tmp_path / "run")
    # the estimate's continuation of the held-out prompt: generated once, read from its cache after
    assert s["acceptance_estimate"]["continuations_cached"] == 0
    again = run_dflash(*args, "--overwrite", env=cache)
    assert _summary(tmp_path / "run")["acceptance_estimate"]["continuations_cached"] == 1
    assert _summary(tmp_path / "run")["eval_after"]["histogram"] == s["eval_after"]["histogram"], again.stderr[-2000:]
    assert "eval_before" not in s and s["eval_after"]["prompts"] == 1
    assert "tau before training" not in p.stderr and "tau after training" in p.stderr
    # the estimate walked the eval's own prompt, cut and continued as the eval decodes it: the
    # last one (the final weights) has the eval's verify steps (tests/unit/test_acceptance_estimate.py
    # checks the equality on a drafter that accepts some drafts)
    est, after = s["acceptance_estimate"], s["eval_after"]
    assert est["rows"] == "held-out eval prompts" and est["max_new_tokens"] == 8
    assert est["last"]["step"] == 2 and est["last"]["histogram"] == after["histogram"], (est, after)
    assert est["last"]["tau"] == after["tau_per_step"]


def test_local_hf_model_dir_as_target(tmp_path):
    """Any local Hugging Face model dir works as --target (here: a tiny Qwen3 saved to disk)."""
    from dflash.model import target as T

    model, tok = T.load_target("tiny-qwen3", seed=3)
    mdir = tmp_path / "my-model"
    model.save_pretrained(mdir)
    tok.save_pretrained(mdir)
    run = tmp_path / "run"
    run_dflash("train", "--out", run, "--target", mdir, "--steps", 2, "--no-telemetry", *TINY,
               "--set", "data.regenerate=on", "--set", "data.num_conversations=16",  # a new target: no cache,
               "--set", "data.regen_max_new_tokens=16")                             # so few, short replies
    cfg = json.loads((run / "checkpoint" / "config.json").read_text())
    assert cfg["target"] == str(mdir) and cfg["hidden_size"] == 256 and cfg["block_size"] == 8
    res = last_json(run_dflash("eval", "--checkpoint", run / "checkpoint", "--json", "--prompts", 2).stdout)
    assert res["lossless"] and res["prompts"] == 2


def test_bf16_train_checkpoint_resume_eval_on_cpu(tmp_path):
    """The whole path a CUDA user takes by default, in bf16 on the CPU (tests/unit/test_precision.py:
    the drafter's fp32 master weights and bf16 compute, in-process)."""
    import torch
    from safetensors.torch import load_file

    run = tmp_path / "bf16"
    common = ["--out", run, "--target", "tiny-qwen3", "--no-telemetry", *TINY, "--set", "model.dtype=bfloat16"]
    run_dflash("train", "--steps", 4, *common, "--set", "train.stop_after=2")
    first = json.loads((run / "summary.json").read_text())
    assert first["steps"] == 2 and first["nonfinite_steps"] == 0
    weights = load_file(str(run / "checkpoint" / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {torch.float32}, "checkpoints hold the fp32 master weights"
    from dflash.checkpoint.checkpoint import load_training_state
    state, _ = load_training_state(run / "checkpoint")
    assert {s["exp_avg"].dtype for s in state["optimizer"]["state"].values()} == {torch.float32}

    # resumed, then evaluated in the same process (the eval a `train --eval` runs after training)
    run_dflash("train", "--steps", 4, *common, "--resume", "--eval", "--set", "eval.before=false",
               "--set", "eval.prompts=2", "--set", "eval.max_new_tokens=16", "--set", "eval.baseline=none")
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 4 and [s for s, _ in resumed["loss_history"]] == [0, 1, 2, 3]
    assert all(l == l and l < 20 for _, l in resumed["loss_history"])  # finite

    res = resumed["eval_after"]
    assert res["dtype"] == "bfloat16", "eval runs in the precision training used"
    assert res["prompts"] == 2 and 1.0 <= res["acceptance_length"] <= 8
    # lossless is reported with its evidence, never as a bare flag
    assert res["lossless_divergent_prompts"] == len(res["lossless_divergences"])
    assert res["lossless"] == (res["lossless_divergent_prompts"] == 0)


def test_a_run_keeps_and_exports_its_best_step(tmp_path):
    """train.estimate_every: the best step's checkpoint and export in OUT/best/, named in the
    summary (tests/unit/test_best_checkpoint.py: which weights BestKeeper keeps)."""
    out = tmp_path / "run"
    est = ["--set", "train.estimate_every=2", "--set", "train.estimate_samples=2"]
    # stopped at step 2 and resumed (issue 54: the resumed summary dropped the earlier part's estimates)
    run_dflash("train", "--out", out, "--target", "tiny-qwen3", "--steps", 4, "--no-telemetry", *TINY, *est,
               "--set", "train.stop_after=2")
    before = json.loads((out / "summary.json").read_text())["acceptance_estimate"]["history"]
    run_dflash("train", "--out", out, "--target", "tiny-qwen3", "--steps", 4, "--no-telemetry", *TINY, *est,
               "--resume")
    s = json.loads((out / "summary.json").read_text())
    hist = s["acceptance_estimate"]["history"]
    assert before and hist[:len(before)] == before and len(hist) > len(before), (before, hist)
    best = max(hist, key=lambda h: h[1])  # the first of the highest
    assert s["best"]["step"] == best[0] and abs(s["best"]["tau_estimate"] - best[1]) < 1e-3
    st = json.loads((out / "best" / "checkpoint" / "trainer_state.json").read_text())
    assert st["step"] == best[0]
    cfg = json.loads((out / "best" / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    # --overwrite clears it with the rest of the earlier run
    run_dflash("train", "--out", out, "--target", "tiny-qwen3", "--steps", 1, "--no-telemetry", *TINY,
               "--overwrite")
    assert not (out / "best").exists()
