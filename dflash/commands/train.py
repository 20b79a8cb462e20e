"""`dflash train`: train a drafter against a frozen target. Every input is checked (config,
layout launch, data, resume fit, run dir) before torch and transformers are imported."""
from __future__ import annotations

import os
import shlex
import sys

from ..config import check_regen_lengths, needs_target_distribution
from ..errors import ConfigError
from . import CommaList, Once


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train a drafter against a frozen target")
    t.add_argument("--out", help="run directory (checkpoint/, summary.json, telemetry/); default: the config's "
                   "out, runs/default")
    t.add_argument("--target", help="smollm2 | tiny-llama | tiny-qwen3 | tiny-qwen3.5 | model dir | hub id")
    t.add_argument("--steps", type=int, help="train.steps: optimizer steps in all (default 200)")
    t.add_argument("--seed", type=int, help="train.seed: the data subset and held-out split, the drafter's "
                   "init, the anchors (default 0)")
    t.add_argument("--config", action=Once, help="YAML file with any of the config keys")
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
    t.add_argument("--no-telemetry", action="store_true",
                   help="telemetry.enabled=false: no spans or metrics, no exporter process (the steps' own "
                        "timing still prints)")
    t.add_argument("--wandb", action="store_true", help="bridge metrics and the run summary to W&B")
    t.add_argument("--tracker", action=CommaList, metavar="NAMES",
                   help="experiment trackers, a comma list of wandb, tensorboard, mlflow (--wandb: wandb)")

    t.add_argument("--features", action=Once, metavar="FEATS",
                   help="train from features dflash capture wrote: no target forward, only the target's "
                        "embedding and lm_head are loaded; target and layer ids come from the capture")
    t.add_argument("--init-from", action=Once, metavar="DIR",
                   help="start from a drafter in the served DFlash format (a published one, a SpecForge or "
                        "dflash export); its layers, block size and target layers replace the config's")


def run(a) -> int:
    from ..phases import fallback, inject_delays, phase

    with phase("check_inputs"):  # the run's first phases: recorded once its telemetry starts
        cfg = _checked_config(a)
    inject_delays(cfg.pipeline.inject_delay, int(os.environ.get("RANK", "0") or 0))  # --inject-delay PHASE=S
    if cfg.telemetry.enabled:  # a signal in the data read (before OUT is ours): the collector, or the table
        fallback("train", None)
    if not cfg.data.features:  # training from a capture: the samples are in it
        with phase("read_data") as ph:
            load_data(cfg)
            ph.set(conversations=cfg.data.num_conversations)
    if a.resume:
        with phase("check_resume"):
            _check_resume(cfg)
    from ..preflight import run_dir
    with phase("claim_run_dir"):
        out = run_dir.claim(cfg.out, resume=a.resume, overwrite=a.overwrite)  # locked until exit
        a.resolved_out = cfg.out  # from here on an unexpected failure leaves OUT/error.txt
        if os.environ.get("RANK", "0") in ("", "0"):  # the rank that holds the lock tidies up
            if a.overwrite:
                run_dir.clear_earlier_run(out)
            if a.resume:
                from ..preflight.checkpoint_files import clean_stale_temps
                clean_stale_temps(out / "checkpoint")
    a.phase = "set-up"  # a signal before training starts: nothing to save yet
    if cfg.telemetry.enabled:  # stopped before the run's telemetry starts: its phases still reach OUT/telemetry
        fallback("train", str(out / "telemetry"))
    with phase("import_torch"):
        from ..run.trainer import train  # torch and transformers: only once the input is known to be good

    s = train(cfg, resume=a.resume, eval_before_after=a.eval, argv=a.argv)
    if s.get("steps") is not None and s.get("lead", s.get("rank", 0) == 0):
        from ..analysis.report import print_summary
        print_summary(s, cfg.out)
    if s.get("interrupted"):
        return 130  # interrupted (Ctrl-C) but saved: scripts can tell
    if s.get("engine") is not None:  # eval.engine: a failed verdict is exit 3, said on the console
        from ..engine.verdict import verdict_exit
        return verdict_exit(s)
    return 0


def _checked_config(a):
    """The run's config, every input checked (one line, exit 2) before torch loads."""
    from ..config import load_config, override

    flags = {"out": a.out, "model.target": a.target, "train.steps": a.steps, "train.seed": a.seed,
             "pipeline.target_devices": a.target_devices, "pipeline.drafter_devices": a.drafter_devices,
             "pipeline.layout": a.layout,
             "pipeline.inject_delay": ",".join(a.inject_delay) or None,
             "pipeline.inject_fault": ",".join(a.inject_fault) or None,
             "pipeline.pipelined": False if a.reference else None,
             "telemetry.enabled": False if a.no_telemetry else None,
             "telemetry.wandb": True if a.wandb else None}
    if a.tracker is not None:
        from ..trackers import check_installed, parse
        flags["telemetry.trackers"] = parse(a.tracker)
        check_installed(flags["telemetry.trackers"])
    asked: dict = {}
    if a.init_from:
        from ..checkpoint.init_from import init_flags, say_replaced
        init = init_flags(a.init_from)
        flags |= init
    cfg = load_config(a.config, a.set, asked=asked, **flags)
    if a.init_from:
        say_replaced(a.init_from, init, asked)
    features = a.features or cfg.data.features
    if features:  # the capture decides target, its seed and the layer ids
        cfg = override(cfg, **train_flags(features, cfg, target_flag=a.target, eval_flag=a.eval,
                                          named=asked | ({"train.seed": a.seed} if a.seed is not None else {})))
    else:
        check_regen_lengths(cfg)
    if a.resume and a.overwrite:
        raise ConfigError("--resume with --overwrite: choose one (continue the earlier run, or replace it)")
    if cfg.pipeline.layout:
        _check_layout_launch(cfg, a.eval)
    if a.eval:
        from ..config import check_walked_eval
        check_walked_eval(cfg)
    if a.eval and cfg.eval.engine == "vllm":  # asked for by name: no engine venv is bad input, said now
        from ..engine.runner import engine_python
        engine_python()
    if a.eval and cfg.eval.engine != "none":
        from ..engine.machine import isa_env
        isa_env()  # a bad DFLASH_VLLM_ISA: one line, before anything loads
    from ..preflight.devices import check_devices
    from ..preflight.launch_checks import check_target, check_torchrun_env
    check_torchrun_env()
    check_devices({"pipeline.target_devices": cfg.pipeline.target_devices,
                   "pipeline.drafter_devices": cfg.pipeline.drafter_devices}, attention=cfg.train.attention)
    check_target(cfg)
    _notice_unused(cfg)
    return cfg


def _notice_unused(cfg) -> None:
    """Settings this run accepts but never reads: one notice line each (rank 0), not an error,
    since one config may serve several arms (bench/architectures.py)."""
    from .. import family
    from ..config import TrainConfig

    t, fam = cfg.train, family.get(cfg.model.arch)
    said = [f"{s}: this run's model.arch is {cfg.model.arch}" for s in family.unused_settings(cfg.model, t)]
    if t.optimizer != "muon":
        said += [f"train.{k}={getattr(t, k)!r} applies to train.optimizer=muon (this run's is {t.optimizer})"
                 for k in ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_adjust_lr")
                 if getattr(t, k) != getattr(TrainConfig, k)]
    if t.loss_chunk > 0 and (fam.reads_full_logits or cfg.model.copy_head):
        said.append(f"train.loss_chunk={t.loss_chunk}: {'a copy head' if cfg.model.copy_head else cfg.model.arch} "
                    f"reads every slot's full logits, so the head runs whole")
    if os.environ.get("RANK", "0") == "0":
        for line in said:
            print(f"dflash train: notice: {line}; ignored", file=sys.stderr)


def load_data(cfg) -> None:
    """The run's conversations, loaded before torch: this picks (and caches) the run's subset,
    which the run reads back in milliseconds, and a data set with fewer than two usable
    conversations is one line (exit 2). `dflash capture` loads its data set the same way."""
    import logging

    from ..data.conversations import load_conversations

    log = logging.getLogger("dflash.data.conversations")
    level = log.level
    log.setLevel(logging.ERROR)  # "fewer than asked" is said by the run itself, or refused below
    try:
        convs = load_conversations(cfg.data.path or None, limit=cfg.data.num_conversations, seed=cfg.train.seed)
    finally:
        log.setLevel(level)
    if len(convs) < 2:
        raise ConfigError(f"dataset {cfg.data.path or 'ShareGPT V3'!r}: {len(convs)} usable conversation(s); "
                          "expected at least 2 (one to train on, one held out)")


def train_flags(path: str, asked, *, target_flag: str | None, eval_flag: bool, named: dict | None = None) -> dict:
    """`dflash train --features FEATS`: the target, its seed and the layer ids come from the
    capture's index; what the user asked (``asked``: the config before them) must not
    contradict it. One line before torch loads. The capture's data settings become the run's
    too (``named``: the keys the user gave, said when overruled): its config.yaml then says
    what the samples came from. train.seed stays the run's own (the drafter's init, the batch
    order: several seeds from one capture); `dflash eval` takes the held-out split's seed from
    the capture's index (commands/eval.py `_split_seed`), never a split the capture trained on."""
    from ..offline.feature_index import FeaturesError, mismatch, read_index

    try:
        idx = read_index(path)
    except FeaturesError as e:
        raise ConfigError(str(e)) from None
    why = mismatch(idx, target=target_flag, layer_ids=asked.model.target_layer_ids)
    if why:
        raise ConfigError(f"--features {path}: {why}")
    if eval_flag:
        raise ConfigError(f"--eval with --features: the run loads no target to decode with; after training run: "
                          f"dflash eval --checkpoint "
                          f"{shlex.quote(f'{asked.out}/checkpoint') if asked.out else 'OUT/checkpoint'}")
    key = idx["key"]
    t = asked.train
    if needs_target_distribution(t.loss, asked.model.arch):  # the target's distribution comes from the capture: enough of it?
        have = idx.get("kl_topk") or 0
        if not have:
            asks = f"train.loss={t.loss}" if t.loss in ("kl", "lk") else f"model.arch={asked.model.arch}"
            raise ConfigError(f"--features {path} with {asks}: the capture kept no target distribution; capture "
                              f"again with --set {asks} (and train.kl_topk=K)")
        if not t.kl_topk or t.kl_topk > have:
            raise ConfigError(f"--features {path}: train.kl_topk={t.kl_topk}: the capture kept the top {have} "
                              f"log-probs per token; set train.kl_topk to 1..{have}")
    if asked.data.max_len != idx["data"]["max_len"]:
        print(f"data.max_len: {idx['data']['max_len']}, the capture's (samples were cut to it when captured)",
              file=sys.stderr)
    data, named = idx["data"], named or {}
    captured = {f"data.{k}": data[k] for k in ("path", "num_conversations", "regenerate", "regen_max_new_tokens",
                                               "regen_max_prompt_len") if data.get(k) is not None}
    for k, v in captured.items():
        if k in named and str(getattr(asked.data, k[5:])) != str(v):
            print(f"dflash train: notice: {k}={named[k]!r}: the capture's samples came from {k}={v!r}, which "
                  f"this run records; ignored", file=sys.stderr)
    too_long = _block_past_the_capture(path, idx, asked.model.block_size)
    if too_long:
        raise ConfigError(too_long)
    return {"data.features": path, "model.target": key["target"], "model.target_seed": key["target_seed"],
            "model.target_layer_ids": key["layer_ids"], "data.max_len": data["max_len"], **captured}


def _block_past_the_capture(path: str, idx: dict, block_size: int) -> str | None:
    """A block size for which no captured sample has its 2 x block_size loss tokens, or None.
    Read before torch and before --overwrite clears anything (it was a traceback after both):
    only where the block is larger than the capture's, from the shards' loss masks (numpy)."""
    need = 2 * block_size
    if need <= idx["data"]["min_loss_tokens"]:
        return None  # the capture kept only samples with at least that many
    import numpy as np
    from safetensors import safe_open

    best = 0
    for shard in idx.get("shards") or []:
        try:
            with safe_open(os.path.join(path, shard["file"]), framework="numpy") as f:
                mask, offsets = f.get_tensor("loss_mask"), f.get_tensor("offsets")
        except Exception:  # a damaged shard is the loader's to name, in its own words
            return None
        sums = np.add.reduceat(mask.astype(np.int64), offsets[:-1]) if len(offsets) > 1 else np.zeros(0)
        best = max(best, int(sums.max(initial=0)))
        if best >= need:
            return None
    return (f"--features {path}: model.block_size={block_size} needs samples with >= {need} loss tokens "
            f"(2 x the block); the longest captured one has {best}: lower model.block_size, or capture again "
            f"with it")


def _check_resume(cfg) -> None:
    """The checkpoint in OUT fits this run (target, block size, layers, layer ids), checked
    from its config.json before torch loads."""
    from ..preflight.checkpoint_files import CheckpointError, check_readable, resume_mismatch, training_state_error
    from ..preflight.inputs import target_num_layers

    if cfg.model.init_from:  # the run's own command again (what_next repeats it): its weights are the checkpoint's
        print(f"dflash train: notice: --init-from {cfg.model.init_from}: a resume continues from "
              f"{cfg.out}/checkpoint; ignored", file=sys.stderr)
    try:
        _, raw = check_readable(os.path.join(cfg.out, "checkpoint"))
        err = training_state_error(os.path.join(cfg.out, "checkpoint"), cfg.train.steps)
    except CheckpointError as e:
        raise ConfigError(f"--resume: {e}") from None
    if err:
        raise ConfigError(f"--resume: {err}")
    from ..config import run_config_error
    err = run_config_error(raw.get("dflash_run") or {})
    if err:
        raise ConfigError(f"--resume: checkpoint {os.path.join(cfg.out, 'checkpoint')!r}: config.json: {err}")
    try:
        why = resume_mismatch(raw, cfg.model, target_num_layers(cfg.model.target))
    except ValueError as e:
        why = str(e)
    trained_with = ((raw.get("dflash_run") or {}).get("train") or {}).get("optimizer")
    if not why and trained_with and trained_with != cfg.train.optimizer:  # its state is the other optimizer's
        why = f"train.optimizer: the checkpoint was trained with {trained_with}, this run uses {cfg.train.optimizer}"
    if why:
        raise ConfigError(f"--resume: {why}; resume with the run's own settings ({cfg.out}/config.yaml) "
                          "or train into a new --out")


def _check_layout_launch(cfg, eval_flag: bool) -> None:
    """A layout needs torchrun with exactly its number of ranks, and has no eval step."""
    from ..run.roles.layout import Layout

    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise ConfigError(f"--layout {cfg.pipeline.layout}: roles are given to torchrun's ranks; launch with "
                          f"torchrun --nproc_per_node N -m dflash train ... (N = ranks on this node)")
    if not world.strip().isdigit():
        raise ConfigError(f"WORLD_SIZE={world!r}: expected a non-negative integer (torchrun sets it)")
    Layout.parse(cfg.pipeline.layout).check_world(int(world))
    if eval_flag:
        raise ConfigError(f"--eval with --layout {cfg.pipeline.layout}: no rank holds both the target and the "
                          "drafter; after training run: dflash eval --checkpoint "
                          f"{shlex.quote(f'{cfg.out}/checkpoint')}")


def what_next(a) -> str:
    """After Ctrl-C: where the last checkpoint is and the command line that continues."""
    import shlex
    from pathlib import Path

    out = getattr(a, "resolved_out", None)
    again = [x for x in a.argv if x not in ("--overwrite", "--resume")]
    if out and (Path(out) / "checkpoint" / "config.json").is_file():
        return f"the last checkpoint is in {out}/checkpoint; continue with: dflash {shlex.join(again + ['--resume'])}"
    if out and Path(out).is_dir():
        again.append("--overwrite")  # nothing saved: the dir holds only this attempt's start
    return f"no checkpoint was saved yet; run it again: dflash {shlex.join(again)}"
