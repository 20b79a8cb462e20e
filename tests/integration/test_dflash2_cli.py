"""model.arch=dflash2 through the command line (docs/architectures.md): two training steps,
the export vLLM loads (DFlash2DraftModel), eval of that export lossless with drafts chosen by
the selector walk (greedy and sampled), the held-out estimate walking the same chain, and
--init-from that export."""
import json

from helpers import TINY, last_json, run_dflash

D2 = ["--set", "model.arch=dflash2", "--set", "model.selector_rank=16", "--set", "model.selector_top_k=8"]


def test_dflash2_trains_exports_evals_losslessly_and_inits_from_its_export(tmp_path):
    run = tmp_path / "run"
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", 2, "--no-telemetry", *TINY, *D2,
               "--set", "eval.prompts=1", "--set", "eval.max_new_tokens=8", "--set", "eval.before=false",
               "--set", "eval.baseline=none", "--set", "train.estimate_every=2", "--set", "train.estimate_samples=1",
               "--eval")
    s = json.loads((run / "summary.json").read_text())
    est, after = s["acceptance_estimate"], s["eval_after"]
    assert after["lossless"]
    # the held-out estimate walks the selector's chain, as the decoder drafts (one pass, no decode)
    assert est["last"]["histogram"] == after["histogram"] and est["last"]["tau"] == after["tau_per_step"]
    export = run / "export"
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert {k: cfg["dflash_config"][k] for k in ("block_size", "selector_rank", "selector_top_k")} == \
        {"block_size": 8, "selector_rank": 16, "selector_top_k": 8}
    res = last_json(run_dflash("eval", "--checkpoint", export, "--json", "--prompts", 1,
                               "--max-new-tokens", 12).stdout)
    assert res["lossless"] and res["prompts"] == 1
    hot = last_json(run_dflash("eval", "--checkpoint", export, "--json", "--prompts", 1, "--max-new-tokens", 6,
                               "--temperature", 0.8).stdout)
    assert hot["prompts"] == 1  # sampled drafts walk the selector; the rule keeps the target's distribution
    again = tmp_path / "again"
    run_dflash("train", "--out", again, "--target", "tiny-qwen3", "--steps", 1, "--no-telemetry", *TINY,
               "--init-from", export)
    back = json.loads((again / "checkpoint" / "config.json").read_text())
    assert back["arch"] == "dflash2" and back["selector_top_k"] == 8


def test_dflash2_resumes_bit_for_bit_and_a_dflash_run_cannot_resume_it(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--target", "tiny-qwen3", "--steps", 4, "--no-telemetry", *TINY, *D2]
    run_dflash("train", "--out", full, *common)
    run_dflash("train", "--out", part, *common, "--set", "train.stop_after=2")
    run_dflash("train", "--out", part, *common, "--resume")
    a = json.loads((full / "summary.json").read_text())["loss_history"]
    b = json.loads((part / "summary.json").read_text())["loss_history"]
    assert a == b, "a resumed DFlash2 run (selector loss included) follows the uninterrupted one exactly"
    p = run_dflash("train", "--out", part, "--target", "tiny-qwen3", "--steps", 6, "--no-telemetry", *TINY,
                   "--set", "model.selector_rank=16", "--resume", check=False)
    # said before torch, from the checkpoint's config.json (it was said after the target loaded)
    assert p.returncode == 2 and "model.arch: the checkpoint is a dflash2 drafter, this run builds a dflash one" \
        in p.stderr, p.stderr[-500:]


def test_a_dflash_export_starts_a_dflash2_run(tmp_path):
    """--init-from a DFlash dir with model.arch=dflash2: its weights (a step at lr ~0 keeps them),
    plus identity convolutions and a fresh selector."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    run_dflash("train", "--out", src, "--target", "tiny-qwen3", "--steps", 1, "--no-telemetry", *TINY)
    up = tmp_path / "up"
    run_dflash("train", "--out", up, "--target", "tiny-qwen3", "--steps", 1, "--no-telemetry", *TINY, *D2,
               "--init-from", src / "export", "--set", "train.lr=1e-12")
    assert json.loads((up / "export" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    a, b = load_file(str(src / "export" / "model.safetensors")), load_file(str(up / "export" / "model.safetensors"))
    assert set(a) < set(b) and all((a[k].float() - b[k].float()).abs().max() < 1e-2 for k in a)
