"""model.arch=dspark through the command line (docs/architectures.md): training with a confidence
head, the export vLLM 0.32 loads (Qwen3DSparkModel), our decoder lossless on it (greedy and
sampled: each slot drawn given the one before it), the held-out estimate walking what the
decoder drafts, and --init-from that export with confidence-gated drafting in the eval. It
drafts from a draft vocabulary (model.draft_vocab, trained over a loss vocabulary), as the
demo's DFlash does: vLLM's reduced-vocabulary DSpark (tests/unit/test_dspark.py has the full one)."""
import json

from helpers import TINY, last_json, run_dflash

DS = ["--set", "model.arch=dspark", "--set", "model.markov_rank=16", "--set", "model.confidence_head=true",
      "--set", "train.kl_topk=16", "--set", "model.draft_vocab=64", "--set", "train.loss_vocab=64"]


def test_dspark_trains_exports_decodes_losslessly_and_gates_its_drafts(tmp_path):
    run = tmp_path / "run"
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", 3, "--no-telemetry", *TINY, *DS,
               "--set", "eval.prompts=2", "--set", "eval.max_new_tokens=10", "--set", "eval.before=false",
               "--set", "eval.baseline=none", "--set", "train.estimate_every=3", "--set", "train.estimate_samples=2",
               "--set", "train.lr=3e-3", "--eval")
    s = json.loads((run / "summary.json").read_text())
    est, after = s["acceptance_estimate"], s["eval_after"]
    assert after["lossless"]
    # the held-out estimate walks the Markov chain as the decoder drafts it (one pass, no decode)
    assert est["last"]["histogram"] == after["histogram"] and est["last"]["tau"] == after["tau_per_step"]
    assert len(after["per_position_acceptance"]) == 7 and after["drafted_per_accepted"] is None or \
        after["drafted_per_accepted"] >= 1.0
    export = run / "export"
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] is False
    assert (cfg["markov_rank"], cfg["enable_confidence_head"], cfg["draft_vocab_size"]) == (16, True, 64)
    res = last_json(run_dflash("eval", "--checkpoint", export, "--json", "--prompts", 1,
                               "--max-new-tokens", 12).stdout)
    assert res["lossless"] and res["prompts"] == 1
    hot = last_json(run_dflash("eval", "--checkpoint", export, "--json", "--prompts", 1, "--max-new-tokens", 6,
                               "--temperature", 0.8).stdout)
    assert hot["prompts"] == 1
    again = tmp_path / "again"
    run_dflash("train", "--out", again, "--target", "tiny-qwen3", "--steps", 1, "--no-telemetry", *TINY,
               "--set", "train.kl_topk=16", "--init-from", export, "--eval", "--set", "eval.prompts=2",
               "--set", "eval.max_new_tokens=10", "--set", "eval.before=false", "--set", "eval.baseline=none",
               "--set", "eval.confidence_threshold=0.999")
    back = json.loads((again / "checkpoint" / "config.json").read_text())
    assert back["arch"] == "dspark" and back["markov_rank"] == 16 and back["confidence_head"]
    assert back["draft_vocab_size"] == 64
    gated = json.loads((again / "summary.json").read_text())["eval_after"]
    # a head trained 4 steps is far from sure of anything: below 0.999 from slot 1, so no draft is
    # verified (every step a plain decode step), and the output is still the target's own
    # (the gate's threshold in between: tests/unit/test_dspark.py)
    assert gated["lossless"] and gated["confidence_threshold"] == 0.999
    assert gated["tau_per_step"] == 1.0 and gated["drafted_per_accepted"] is None
    # its export carries the run's threshold: eval gates by it (an export names no arch, and was
    # refused as a DFlash before), and --confidence-threshold overrides it
    ev = ["eval", "--checkpoint", again / "export", "--json", "--prompts", 1, "--max-new-tokens", 6]
    inherited = last_json(run_dflash(*ev).stdout)
    assert inherited["confidence_threshold"] == 0.999 and inherited["tau_per_step"] == 1.0
    assert last_json(run_dflash(*ev, "--confidence-threshold", 0).stdout)["confidence_threshold"] == 0.0


def test_muon_trains_and_resumes_bit_for_bit(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--target", "tiny-qwen3", "--steps", 4, "--no-telemetry", *TINY, "--set", "train.optimizer=muon"]
    run_dflash("train", "--out", full, *common)
    run_dflash("train", "--out", part, *common, "--set", "train.stop_after=2")
    run_dflash("train", "--out", part, *common, "--resume")
    a = json.loads((full / "summary.json").read_text())["loss_history"]
    b = json.loads((part / "summary.json").read_text())["loss_history"]
    assert a == b, "a resumed Muon run (its momenta and schedule) follows the uninterrupted one exactly"
    p = run_dflash("train", "--out", part, "--target", "tiny-qwen3", "--steps", 6, "--no-telemetry", *TINY,
                   "--resume", check=False)
    assert p.returncode == 2 and "the checkpoint was trained with muon" in p.stderr, p.stderr[-500:]
