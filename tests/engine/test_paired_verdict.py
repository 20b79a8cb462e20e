"""The paired verdict (issue 55) through the command line users run: every engine up at once,
the prompts asked of all at once and run in turns, in a rotated order over 2 rounds, each ratio with its 95% interval
in the JSON, the machine named, the idle engines frozen (measured: no CPU while another
serves), the cost of a verify step split, and the k picked from it recorded in the export
for `serve --k auto`. Correctness only: the figures' values are the machine's."""
from __future__ import annotations

import json
import shutil

from helpers import last_json, run_dflash


def test_one_paired_verdict_on_tiny_qwen3_with_intervals(tmp_path, tiny_export):
    from dflash.engine import kchoice
    from dflash.preflight.checkpoint_files import SERVING_K

    export = tmp_path / "export"  # the shared fixture stays as it is: the verdict writes its k here
    shutil.copytree(tiny_export, export)
    p = run_dflash("eval", "--checkpoint", export, "--target", "tiny-qwen3", "--prompts", 4, "--max-new-tokens", 24,
                   "--engine", "vllm", "--engine-eager", "--engine-no-batched", "--engine-rounds", 2,
                   "--engine-prompts", 3, "--json", timeout=1800)
    assert "paired and interleaved" in p.stdout and "machine: " in p.stdout, p.stdout
    res = last_json(p.stdout)
    v = res["engine"]
    assert v["paired"] and v["rounds"] == 2 and v["prompts"] == 3
    # asked at once, run in turns of eval.engine_turn_ms (50 by default), each request timed by its engine's turns
    assert v["turn_ms"] == 50 and "run in turns of 50 ms" in p.stdout, p.stdout
    assert v["machine"]["vllm_kernels"] in ("_C", "_C_AVX512", "_C_AVX2") and v["machine"]["logical_cpus"] >= 1
    m = v["methods"]
    label = str(export)
    assert {"none", "ngram", label} <= set(m)
    for name, fig in m.items():
        assert len(fig["per_request_s"]) == 3 and all(len(r) == 2 and all(t > 0 for t in r)
                                                        for r in fig["per_request_s"]), name
        assert fig["rounds_equal"] and (name == "none" or fig["lossless"]), name
        assert fig["memory_gib"] and fig["memory_gib"] > 0.5
    for name in set(m) - {"none"}:
        sp = m[name]["speedup_vs_none"]
        lo, hi = sp["concurrency_1_interval"]
        assert lo <= sp["concurrency_1"] <= hi and sp["level"] == 0.95, sp
        assert sp["decided"] in ("faster", "slower", "undecided")
    assert "concurrency_1_interval" in m[label]["speedup_vs_ngram"]
    # the interval's own arithmetic, from the per-request times the JSON keeps
    from dflash.engine.pairing import interval
    iv = interval(m["none"]["per_request_s"], m[label]["per_request_s"])
    assert [iv["low"], iv["high"]] == m[label]["speedup_vs_none"]["concurrency_1_interval"]
    fixed = interval(m["none"]["per_request_s"], m[label]["per_request_s"], these_prompts=True)
    assert [fixed["low"], fixed["high"]] == m[label]["speedup_vs_none"]["these_prompts"]["interval"]
    # 3 of the eval's 4 prompts timed: each ratio also over all 4, from the time per forward pass on the 3
    # and our passes on each (engine/pairing.steps_interval), as the JSON's own numbers recompute it
    from dflash.engine.pairing import steps_interval
    from dflash.engine.verdict import our_steps
    held = res["per_prompt_steps"]
    assert len(held) == 4 and [h["prompt_ids"] for h in held[:3]] == [s["prompt_ids"] for s in held[:3]]
    wide = m[label]["speedup_vs_none"]["held_out"]
    again = steps_interval(m["none"]["per_request_s"], m[label]["per_request_s"], our_steps(held, "none"),
                           our_steps(held, "drafter", m[label]["k"], 8))
    assert (wide["prompts"], wide["timed_prompts"]) == (4, 3) and wide["interval"] == [again["low"], again["high"]]
    assert "held_out" in m[label]["speedup_vs_ngram"] and "over all 4 held-out prompts" in p.stdout
    # what that rests on, checked on the timed prompts: our passes against vLLM's (its tokens less its accepted)
    for name in ("ngram", label):
        check = m[name]["passes_vs_ours"]
        assert check["prompts"] == 3 and check["ours"] > 0 and check["vllm"] > 0, (name, check)
    assert m[label]["passes_vs_ours"]["max_abs_diff"] <= 1, m[label]["passes_vs_ours"]  # agreement: within 1 a prompt
    assert m["ngram"]["passes_vs_ours"]["within_bound"] == 3, m["ngram"]["passes_vs_ours"]  # vLLM's rule, walked
    # idle engines frozen: the CPU they used while another served is a rounding error of the timed seconds
    idle = v["idle_engines"]
    assert idle["frozen"] and idle["timed_s"] > 0 and idle["cpu_s"] < 0.05 * idle["timed_s"], idle
    # the cost split and what it predicts, for every method
    for name in ("none", "ngram", label):
        c = m[name]["cost_per_step_ms"]
        assert c["verify"] > 0 and c["steps_profiled"] > 0, (name, c)
        assert abs(c["step"] - (c["verify"] + c["drafter"] + c["rest"])) < 1e-2
    assert m[label]["cost_per_step_ms"]["drafter"] > 0 and m["none"]["cost_per_step_ms"]["drafter"] == 0
    assert m[label]["predicted_speedup_vs_none"] > 0 and m[label]["break_even_tokens_per_step"]["vs_none"] > 0
    # k from the measurements: picked, served beside block_size - 1 when it differs, recorded in the export
    got = v["k_auto"][label]
    assert 1 <= got["k"] <= 7 and got["block_k"] == 7
    ks = {fig["k"] for name, fig in m.items() if name.startswith(label)}
    assert ks == {7, got["predicted_k"]} if got.get("predicted_k") else ks == {7}
    rec = json.loads((export / SERVING_K).read_text())
    assert rec["k"] == got["k"] and rec["machine"]["vllm_kernels"] == v["machine"]["vllm_kernels"]
    assert kchoice.serve_k(str(export), 8)[0] == got["k"]
