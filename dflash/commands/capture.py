"""The command lines of capture-once-train-many, checked before torch loads:

    dflash capture --target SPEC --out FEATS [--config C] [--set k=v] [--overwrite | --resume]
    dflash train --features FEATS ...   (run settings come from the capture's index)
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from ..config import check_regen_lengths, needs_target_distribution
from ..errors import ConfigError
from ..offline.feature_index import INDEX, PART_GLOB, SHARD_GLOB, TARGET_DIR
from . import Once


def add_parser(sub) -> None:
    c = sub.add_parser("capture", help="run the target once over the prepared data and keep its features on disk "
                                       "(then: dflash train --features FEATS, as often as you like)")
    c.add_argument("--out", required=True, metavar="FEATS", help="the directory to write (shards + index.json)")
    c.add_argument("--target", help="smollm2 | tiny-llama | tiny-qwen3 | tiny-qwen3.5 | model dir | hub id")
    c.add_argument("--config", action=Once, help="YAML file with any of the config keys (data.*, model.* decide what is captured)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    c.add_argument("--seed", type=int, help="train.seed: which conversations are picked and held out")
    c.add_argument("--target-devices", help="the device of this rank's target, e.g. cuda (default cpu)")
    c.add_argument("--shard-mb", type=int, default=512, help="feature MB per shard file (default 512)")
    c.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="who runs the target: hf (the loaded model's forward, default) or vllm (vLLM's "
                        "extract_hidden_states in .venv-vllm, one engine start per rank)")
    c.add_argument("--engine-tp", type=int, default=1, metavar="N",
                   help="--engine vllm (and data.regen_engine=vllm): vLLM's tensor_parallel_size, the GPUs "
                        "CUDA_VISIBLE_DEVICES names (default 1; sets DFLASH_VLLM_TP)")
    c.add_argument("--overwrite", action="store_true", help="replace an earlier capture in FEATS")
    c.add_argument("--resume", action="store_true",
                   help="continue a stopped capture in FEATS (same settings): its whole shards are kept, only "
                        "the samples they lack are captured")


def run(a) -> int:
    from .. import phases

    with phases.phase("check_inputs"):  # recorded in the capture's trace once its telemetry starts
        cfg = _checked_config(a)
    if cfg.telemetry.enabled:  # a signal in the data read (before FEATS is ours): the collector, or the table
        phases.fallback("capture", None)
    with phases.phase("read_data"):
        from .train import load_data
        load_data(cfg)
    if a.resume:
        check_resumable(cfg.out)
    from ..preflight import run_dir
    rank, world = int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    with phases.phase("claim_run_dir"):
        out = run_dir.claim(cfg.out, resume=a.resume, overwrite=a.overwrite, by="dflash capture")
        if rank == 0:  # before the ranks meet: no rank writes yet
            if a.overwrite:
                clear_earlier_capture(out)
            elif a.resume:
                _remove(out, (f".{INDEX}.tmp*", f".{SHARD_GLOB}.tmp*"))  # a killed rank's unfinished files
    a.phase = "capture"
    if cfg.telemetry.enabled:  # stopped before the telemetry starts (below): its phases still reach it
        phases.fallback("capture", str(out / "telemetry"))
    with phases.phase("import_torch"):
        from ..offline.capture import agreed_run_id, capture
        from ..run.distributed import agent_store, early_run_id
    # the capture's telemetry: FEATS/telemetry (per rank under torchrun), the ranks in one trace:
    # its id from torchrun's store before the ranks join, else agreed by joining first (the join
    # is then a phase recorded once the telemetry starts)
    rid = early_run_id(world) if world <= 1 or agent_store() else agreed_run_id(world)
    phases.start("capture", file_dir=str(out / "telemetry" / (f"rank{rank}" if world > 1 else "")),
                 run_id=rid, argv=a.argv, enabled=cfg.telemetry.enabled, rank=rank, world=world,
                 mode=cfg.telemetry.mode)

    index = capture(cfg, out, shard_bytes=a.shard_mb * 2**20, resume=a.resume, engine=a.engine)
    if index:
        print(f"captured {index['samples']} samples, {index['tokens']} tokens, {index['bytes'] / 1e6:.1f} MB "
              f"({index['bytes_per_token']:.0f} bytes/token; layers {index['key']['layer_ids']}, "
              f"{index['key']['dtype']}) -> {out}\n"
              f"train from it: dflash train --features {shlex.quote(str(out))} --out RUN")
    return 0


def _checked_config(a):
    """The capture's config, every input checked (one line, exit 2) before torch loads."""
    from ..config import load_config
    from ..preflight.launch_checks import check_target, check_torchrun_env

    if a.shard_mb < 1:
        raise ConfigError(f"--shard-mb={a.shard_mb}: expected an integer >= 1")
    if a.resume and a.overwrite:
        raise ConfigError("--resume with --overwrite: choose one (continue the capture in FEATS, or replace it)")
    # a capture trains no drafter: its devices follow the target's, or the config's rule for
    # training (no CPU drafter beside a CUDA target) refused every --target-devices cuda
    cfg = load_config(a.config, a.set, **{"out": a.out, "model.target": a.target, "train.seed": a.seed,
                                          "pipeline.target_devices": a.target_devices,
                                          "pipeline.drafter_devices": a.target_devices})
    if cfg.data.features:
        raise ConfigError(f"data.features={cfg.data.features!r}: a capture runs the target; unset it")
    check_regen_lengths(cfg)
    if needs_target_distribution(cfg.train.loss, cfg.model.arch) and not cfg.train.kl_topk:
        why = (f"model.arch={cfg.model.arch}" if cfg.train.loss not in ("kl", "lk") else f"train.loss={cfg.train.loss}")
        raise ConfigError(f"{why} with train.kl_topk=0: a capture keeps the target's top-k "
                          "next-token log-probs per token, not whole rows (a vocabulary of fp16 per token); "
                          "set train.kl_topk=K (6 bytes a token each)")
    if a.engine_tp < 1:
        raise ConfigError(f"--engine-tp={a.engine_tp}: expected an integer >= 1")
    if a.engine_tp > 1:
        if a.engine != "vllm" and cfg.data.regen_engine != "vllm":
            raise ConfigError(f"--engine-tp={a.engine_tp} without vLLM: give --engine vllm or "
                              "--set data.regen_engine=vllm (the HF target runs on one device)")
        os.environ["DFLASH_VLLM_TP"] = str(a.engine_tp)
    if a.engine == "vllm":
        check_vllm_capture(cfg)
    check_torchrun_env()
    from ..preflight.devices import check_devices
    check_devices({"pipeline.target_devices": cfg.pipeline.target_devices})  # a capture trains no drafter
    check_target(cfg)
    return cfg


def check_vllm_capture(cfg) -> None:
    """--engine vllm: what it cannot do, one line before torch loads (exit 2), and the engine's
    venv (EngineError, exit 2, when there is none)."""
    from ..engine.runner import engine_python

    if needs_target_distribution(cfg.train.loss, cfg.model.arch):
        raise ConfigError(f"--engine vllm with train.loss={cfg.train.loss}: vLLM's hidden-state extraction gives "
                          "no next-token log-probs; capture with --engine hf")
    engine_python()


def what_next(a) -> str | None:
    """Ctrl-C during the capture: its whole shards are kept, and --resume continues."""
    import shlex

    if getattr(a, "phase", "") != "capture":
        return None
    feats = Path(a.out).expanduser()
    if any(feats.glob(SHARD_GLOB)) and not (feats / INDEX).is_file():  # its whole shards are kept
        again = [x for x in a.argv if x not in ("--overwrite", "--resume")]
        return f"the shards on disk are kept; continue with: dflash {shlex.join(again + ['--resume'])}"
    return None


def check_resumable(out: str) -> None:
    """--resume: FEATS holds a capture that stopped (shards, no index). One line if not."""
    p = Path(out).expanduser()
    if (p / INDEX).is_file():
        raise ConfigError(f"--resume: {out} holds a finished capture (it has its {INDEX}); train from it with "
                          f"dflash train --features {shlex.quote(str(out))}, or capture again with --overwrite")
    if not p.is_dir() or not any(p.glob(SHARD_GLOB)):
        raise ConfigError(f"--resume: no shards in {out} to continue from; run dflash capture without --resume")
    from ..offline.feature_index import FeaturesError, shards_on_disk

    try:  # every shard that would be kept, checked now: not after capturing all the rest
        shards_on_disk(p, f"--resume {out}")
    except FeaturesError as e:
        raise ConfigError(f"{e}; capture again with --overwrite") from None


def clear_earlier_capture(out: Path) -> None:
    """--overwrite: remove an earlier capture's files by name (its telemetry too); a user's
    file stays."""
    _remove(out, (INDEX, SHARD_GLOB, PART_GLOB, f".{SHARD_GLOB}.tmp*", f".{INDEX}.tmp*", f"{TARGET_DIR}/config.json",
                  "telemetry/traces.jsonl", "telemetry/metrics.jsonl", "telemetry/rank*/traces.jsonl",
                  "telemetry/rank*/metrics.jsonl"))
    for d in [*sorted(out.glob("telemetry/rank*")), out / "telemetry", out / TARGET_DIR]:
        try:
            d.rmdir()  # only once empty: a user's file in it keeps it
        except OSError:
            pass


def _remove(out: Path, patterns) -> None:
    for pattern in patterns:
        for f in out.glob(pattern):
            if f.is_file():
                f.unlink()

