"""The demo's verdict with vLLM compiled or eager (`eval.engine_eager`), on one trained run.

`make demo` ends with vLLM serving its export beside ngram and no speculation; on 2 cores most
of that verdict is three engine starts, each with ~100 s of torch.compile warm-up. This bench
runs the verdict the run's own `train --eval` ran (engine/verdict.engine_verdict on the
eval's first `eval.engine_prompts` prompts and their output lengths) once per mode, one after
the other: compiled with an empty vLLM compile cache (what a fresh machine pays: its own
VLLM_CACHE_ROOT), then eager. It prints each mode's wall, each engine's start, tokens/s and
the speed-ups the verdict reports, so a mode is chosen on what it does to the verdict, not on
its time alone.

    .venv/bin/python bench/verdict_modes.py --run runs/demo        # ~15 min, alone (an engine takes both cores)

The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=str(ROOT / "runs" / "demo"), help="a `train --eval` run dir with its export")
    ap.add_argument("--modes", default="compiled,eager")
    args = ap.parse_args()
    from dflash.config import load_config
    from dflash.engine.targets import engine_target
    from dflash.engine.machine import describe
    from dflash.engine.verdict import engine_verdict

    run = Path(args.run)
    summary = json.loads((run / "summary.json").read_text())
    cfg = load_config(str(run / "config.yaml"))
    after = summary["eval_after"]
    steps = after["per_prompt_steps"][:cfg.eval.engine_prompts or None]
    export = str(run / "export")
    k = after["block_size"] - 1
    target = engine_target(cfg.model.target, cfg.model.target_seed)
    out = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="verdict-modes-") as tmp:
            if mode == "compiled":  # a cold compile cache, as on a fresh machine
                os.environ["VLLM_CACHE_ROOT"] = tmp
            (Path(tmp) / "logs").mkdir()
            t0 = time.monotonic()
            v = engine_verdict(target=target, dtype=after["dtype"], steps=steps,
                               drafters=[{"label": "drafter", "export": export, "k": k, "steps": steps}],
                               ngram_k=k, batched=cfg.eval.engine_batched, eager=mode == "eager",
                               log_dir=Path(tmp) / "logs", temperature=cfg.eval.temperature, seed=cfg.train.seed)
            wall = time.monotonic() - t0
            os.environ.pop("VLLM_CACHE_ROOT", None)
        m = v["methods"]
        row = {"wall_s": round(wall, 1),
               "load_s": {x: m[x]["load_s"] for x in m},
               "tokens_per_s": {x: m[x]["tokens_per_s"]["concurrency_1"] for x in m},
               "drafter_vs_none": m["drafter"]["speedup_vs_none"]["concurrency_1"],
               "drafter_vs_ngram": m["drafter"]["speedup_vs_ngram"]["concurrency_1"],
               "ngram_vs_none": m["ngram"]["speedup_vs_none"]["concurrency_1"],
               "tau_per_step": {x: m[x].get("tau_per_step") for x in ("ngram", "drafter")},
               "lossless": all(m[x]["lossless"] for x in m), "machine": v.get("machine")}
        out[mode] = row
        print(f"{mode}: verdict {row['wall_s']:.0f} s; starts {row['load_s']}; tok/s {row['tokens_per_s']}; "
              f"drafter {row['drafter_vs_none']:.2f}x none, {row['drafter_vs_ngram']:.2f}x ngram; "
              f"ngram {row['ngram_vs_none']:.2f}x none; lossless {row['lossless']}; machine: "
              f"{describe(row['machine'])}", file=sys.stderr, flush=True)
    print(json.dumps({"run": str(run), "prompts": len(steps), "modes": out}))


if __name__ == "__main__":
    main()
