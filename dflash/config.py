"""One dataclass tree for a run: defaults <- YAML file <- `--set key=value` <- flags.

Everything is validated here, before any model or data set is touched, so bad input
fails in milliseconds with one line naming the value (ConfigError -> exit code 2).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import family
from .errors import ConfigError
from .family import BLOCK_SIZE, BLOCK_SIZES, DRAFTER_LAYERS, EVAL_FIELDS, MODEL_FIELDS, TRAIN_FIELDS
from .preflight.checkpoint_files import MAX_SLIDING_WINDOW
from .preflight.inputs import short_repr as _short


@dataclass
class _Model:
    target: str = "tiny-qwen3"          # smollm2 | tiny-llama | tiny-qwen3 | tiny-qwen3.5 | dir | hub id
    target_seed: int = 0                 # weights of tiny random targets
    num_layers: int = 1                  # drafter decoder layers (5 in the paper; 1 for CPU)
    block_size: int = BLOCK_SIZE
    num_target_layers: int = 3           # n layers fused into the context
    target_layer_ids: list[int] = field(default_factory=list)  # empty: spread evenly
    dtype: str = "auto"                  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16
    drafter_init: str = "random"         # random | target (decoder layers from the target's last ones)
    copy_head: bool = False              # propose copies from the context, trust learned (model/copy_head.py)
    draft_vocab: int = 0                 # >0: draft from the K most frequent training tokens only, through their
                                         # lm_head rows (exported as lm_head + d2t, as vLLM reads EAGLE-3's)
    init_from: str = ""                  # a drafter dir to start from (dflash train --init-from; checkpoint/init_from.py)
    layer_types: list[str] = field(default_factory=list)  # one per drafter layer: sliding_attention |
                                         # full_attention; empty: all full (docs/architectures.md)
    sliding_window: int = 0              # W of the sliding layers: a block query at t sees positions j with |t-j| < W
    arch: str = family.DEFAULT           # the drafter family: dflash | dflash2 (grouped convs + candidate selector) |
                                         # dspark (Markov head + confidence head); dflash/family/, docs/architectures.md


# Each section's fields, then each drafter family's own (dflash/family/<name>.py declares them, with
# their defaults, comments and bounds): the bases' order puts this section's own fields first.
@dataclass
class ModelConfig(*reversed(MODEL_FIELDS), _Model):
    pass


@dataclass
class DataConfig:
    path: str = ""                       # ShareGPT json; empty = the embedded ShareGPT V3
    num_conversations: int = 384
    max_samples: int = 0                 # >0: train on the first N prepared samples only (a capture's too): one
                                         # regeneration or capture, several data sizes (bench/data_scale.py)
    max_len: int = 256
    long_samples: str = "cut"            # a conversation longer than max_len: cut (its first max_len tokens) |
                                         # split (every max_len window a sample: read text with train.loss=kl)
    regenerate: str = "auto"             # auto (on for tiny random targets) | on | off
    regen_max_new_tokens: int = 96
    regen_max_prompt_len: int = 128
    regen_batch_size: int = 0            # prompts per generate() call, sorted by length; 0: auto (64 on CUDA, 16 on CPU)
    regen_workers: int = 0               # batches generated at once by threads of one process, the compute threads
                                         # shared out among them; 0: auto (on a CPU one per compute thread, up to 8:
                                         # a decode step is hundreds of small parallel regions that 2 threads split
                                         # poorly, bench/target_tokens.py; 1 elsewhere)
    regen_engine: str = "hf"             # hf (the loaded target's generate) | vllm (vLLM's offline API in .venv-vllm,
                                         # one engine start per rank: engine/pipeline.py); same prompts, greedy, cache
    eval_fraction: float = 0.05
    features: str = ""                   # a dir from `dflash capture`: train on its features, no target forward
    chat_template: str = ""              # a Jinja file that replaces the target tokenizer's chat template
    chat_template_kwargs: dict[str, typing.Any] = field(default_factory=dict)  # template variables, e.g.
                                         # {enable_thinking: false}; both apply wherever the template does


# The loss names train.loss / train.loss_weights take (the losses: model/losses.py). Here, not
# there: this module validates them without importing torch, and model/ builds on config.
LOSSES = ("ce", "kl", "lk")
ATTENTIONS = ("sdpa", "flex")    # train.attention: the drafter's block attention (model/drafter.py `attend`)
WEIGHTINGS = ("decay", "dpace")
OPTIMIZERS = ("adamw", "muon")   # train.optimizer (run/step.py)
MUON_LR_RULES = ("match_rms_adamw", "original")  # train.muon_adjust_lr: torch.optim.Muon's adjust_lr_fn


def needs_target_distribution(loss: str, arch: str = family.DEFAULT) -> bool:
    """Whether the loss compares against the target's next-token distribution, which the target
    side must then hand over (or a capture keep): `train.loss` kl or lk, or a drafter family
    whose own loss does (DSpark's L1 distance: family/dspark.py)."""
    return loss in ("kl", "lk") or family.of({"arch": arch}).reads_target_distribution


@dataclass
class _Train:
    steps: int = 200
    batch_size: int = 4
    num_anchors: int = 8
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    loss_gamma: float = 0.0              # decay of the per-slot loss weights; 0: by block size (7 for 16)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 0                  # 0: only at the end
    stop_after: int = 0                  # >0: stop (and checkpoint) after this step, as a preempted job would
    estimate_every: int = 0              # >0: held-out tau per verify step every N steps, walked from one
                                         # drafter pass (run/acceptance_estimate.py)
    estimate_samples: int = 4            # the first N held-out eval prompts it walks (a capture run: N
                                         # samples kept out of training instead)
    loss_vocab: int = 0                  # >0: the loss's softmax over the K most frequent training tokens plus
                                         # the batch's own (a CPU step is mostly the 49k lm_head); 0: all
    feature_cache: bool = False          # keep every training sequence's target features in memory after its
                                         # first forward, so later epochs skip the (frozen) target: for small
                                         # data sets that fit (demo: ~120 seqs x 160 tokens x 3 layers, ~130 MB)
    loss: str = "ce"                     # ce (the target's greedy token) | kl (forward KL to the target's
                                         # distribution) | lk (LK hybrid: KL -> acceptance); model/losses.py
    loss_weights: str = "dpace"          # per-slot weights: dpace (from the drafter's own confidence, D-PACE;
                                         # the field's default, >= decay in docs/losses.md) | decay (the
                                         # paper's fixed decay, loss_gamma); model/losses.py
    kl_topk: int = 64                    # kl / lk: the target's k most likely tokens + one bucket for the rest;
                                         # 0: the whole distribution (online only). Captures keep k per token
    dpace_alpha: float = 0.5             # dpace: confidence smoothing, s = (1 - a) q + a
    lk_eta: float = 3.0                  # lk: lam = exp(-eta * acceptance) blends KL into 1 - acceptance
    loss_chunk: int = 0                  # the lm_head + loss over this many slot rows at a time, never the whole
                                         # [rows x vocab] logits (model/head_loss.py); 0: auto (4096 on CUDA, off
                                         # on the CPU); -1: off. Not with a copy head, dflash2 or dspark (they read logits)
    attention: str = "sdpa"              # the drafter's block attention in training: sdpa (a bool mask) | flex
                                         # (flex_attention with a block mask, compiled on CUDA: skips empty tiles)
    compile: bool = False                # torch.compile each drafter layer (CUDA; the CPU runs them eagerly)
    optimizer: str = "adamw"             # adamw | muon (torch.optim.Muon for the 2-D weight matrices, AdamW for the
                                         # rest, as vLLM's speculators splits them: run/step.py)
    muon_lr: float = 0.0                 # muon: its learning rate (0: train.lr, speculators' default)
    muon_momentum: float = 0.95          # muon: momentum (Nesterov)
    muon_weight_decay: float = 0.1       # muon: weight decay of the matrices it updates
    muon_adjust_lr: str = "match_rms_adamw"  # muon: its per-matrix rate, match_rms_adamw (updates of AdamW's RMS, so
                                         # AdamW's rates carry over: Moonshot's) | original (Keller Jordan's)


@dataclass
class TrainConfig(*reversed(TRAIN_FIELDS), _Train):
    pass


@dataclass
class _Eval:
    prompts: int = 8
    max_new_tokens: int = 48
    max_prompt_len: int = 128
    before: bool = True                  # with `train --eval`: also measure the untrained drafter (tau ~1.0);
                                         # off, the learning curve's step-0 estimate is the baseline
    temperature: float = 0.0             # 0: greedy (lossless per prompt); > 0: speculative sampling (decode/sampling.py)
    top_p: float = 1.0                   # with temperature > 0: nucleus sampling (1: off)
    top_k: int = 0                       # with temperature > 0: only the k most likely tokens (0: off)
    baseline: str = "prompt_lookup"      # also decode every prompt with prompt lookup (the free baseline) | none
    engine: str = "none"                 # with `train --eval`: the engine's verdict on OUT/export after the eval:
                                         # vllm (.venv-vllm, `make vllm`) | auto (vllm where set up, else a line
                                         # saying how) | none (docs/serving.md)
    decode: bool = True                  # false (with train.estimate_every): `train --eval` scores the served
                                         # drafter by the walk over the held-out prompts (equal to decoding, in
                                         # seconds; prompt lookup from the same outputs) and leaves decoding and
                                         # the lossless check to the engine's verdict (the demo's time budget)
    engine_prompts: int = 0              # eval.engine: the first N of the eval's prompts (0: all of them)
    engine_batched: bool = True          # eval.engine: also time every prompt at once (false: concurrency 1 only)
    engine_eager: bool = False           # eval.engine: vLLM without torch.compile (enforce_eager): on a CPU each
                                         # engine starts ~100 s sooner, and decodes slower; every method alike
    engine_rounds: int = 2               # eval.engine: every prompt asked of every engine this many times, the
                                         # engines interleaved (the paired verdict: each ratio's 95% interval)
    engine_turn_ms: float = 50.0         # eval.engine: every engine asked each prompt at once and run in turns of
                                         # this many ms, the others stopped, so the host's sub-second swings in
                                         # speed land on all of them alike (0: whole requests, one engine after
                                         # another; engine/paired.py, docs/serving.md: bench/verdict_turns.py)


@dataclass
class EvalConfig(*reversed(EVAL_FIELDS), _Eval):
    pass


@dataclass
class PipelineConfig:
    pipelined: bool = True               # false: the single-process reference loop
    target_devices: list[str] = field(default_factory=lambda: ["cpu"])
    drafter_devices: list[str] = field(default_factory=lambda: ["cpu"])
    queue_size: int = 4
    min_ready: int = 1
    prefetch: int = 8
    stall_threshold_s: float = 0.05      # queue_get waits longer than this get a span event
    layout: str = ""                     # under torchrun: "target:N,drafter:M" (roles by rank); empty: every rank a replica
    handoff: str = "auto"                # layout: what carries hidden states: auto (nccl when all on CUDA) | nccl | gloo
    rank_timeout_s: float = 600.0        # layout: how long a rank waits on a peer that hangs (a dead one fails at once)
    inject_delay: dict[str, float] = field(default_factory=dict)  # STAGE -> seconds (testing)
    inject_fault: dict[str, int] = field(default_factory=dict)    # STAGE -> step at which it raises (testing)


@dataclass
class TelemetryConfig:
    enabled: bool = True
    mode: str = "process"                # process | thread (where export work runs)
    console_interval_s: float = 0.0      # 0: profile table only at the end
    wandb: bool = False
    trackers: list[str] = field(default_factory=list)  # experiment trackers fed by the bridge (dflash/trackers):
                                         # wandb | tensorboard | mlflow; `wandb: true` is the same as naming wandb


@dataclass
class Config:
    out: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


TRACKERS = ("wandb", "tensorboard", "mlflow")  # dflash/trackers: one sink each

STAGES = ("data_load", "model_forward", "pack_hidden", "cpu_copy_enqueue", "queue_get",
          "drafter_forward", "backward", "optimizer_step")


# -- parsing ------------------------------------------------------------------------------
def _coerce(value, typ, key: str):
    """Coerce a YAML/CLI value to the field's declared type, or raise ConfigError."""
    origin = typing.get_origin(typ)
    if origin is list:
        (inner,) = typing.get_args(typ)
        if isinstance(value, str) and value.lstrip().startswith("["):  # the YAML/JSON form: [1, 5]
            value = _yaml(value, f"{key}={_short(value)}", "a valid list")
        elif isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]  # "a, b": the spaces are not the names
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r}: expected a list")
        return [_coerce(v, inner, key) for v in value]
    if origin is dict:
        kt, vt = typing.get_args(typ)
        if isinstance(value, str) and value.lstrip().startswith("{"):  # a YAML/JSON mapping: {a: 1, b: x}
            value = _yaml(value, f"{key}={_short(value)}", "a valid mapping")
        elif isinstance(value, str):
            pairs = [p for p in value.split(",") if p.strip()]
            value = {}
            for p in pairs:
                if "=" not in p:
                    raise ConfigError(f"{key}: {p!r} is not KEY=VALUE")
                k, v = p.split("=", 1)
                # a value of any type (template variables): read as YAML, so false is a bool
                value[k.strip()] = _yaml(v, f"{key}: {k.strip()}={_short(v)}") if vt is typing.Any and v.strip() else v
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return {_coerce(k, kt, key): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}  # the entry named
    if typ is bool:
        if isinstance(value, bool):
            return value
        s = str(value).lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected {typ.__name__}")
        try:
            out = typ(value)
        except (TypeError, ValueError, OverflowError):  # int(inf), int(nan), int("x")
            raise ConfigError(f"{key}={value!r}: expected {typ.__name__}") from None
        if typ is int and isinstance(value, float) and value != out:
            raise ConfigError(f"{key}={value!r}: expected int")
        return out
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r}: expected a string")
        if value is None:  # `target:` with nothing after it in a file
            raise ConfigError(f"{key}: empty; expected a string (leave the key out for its default)")
        if isinstance(value, bool):  # YAML 1.1 reads a bare on/off/yes/no as a bool (`regenerate: off`)
            return "on" if value else "off"
        return str(value)
    return value


def run_config_error(run) -> str | None:
    """One phrase naming the first value of a run config (a checkpoint's `dflash_run`, as
    `dumps` wrote it) that is not of its field's type, or None. A hand-edited "x" where a
    section goes, or a list where model.target goes, is named here, never an AttributeError
    from whoever reads it later. Keys this version does not know are not judged."""
    if not isinstance(run, dict):
        return f"dflash_run={str(run)[:60]!r}: expected a mapping (the run's config)"
    top = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        got = run.get(section.name)
        if got is None:
            continue
        if not dataclasses.is_dataclass(getattr(Config(), section.name)):  # a top-level value (`out`)
            try:
                _coerce(got, top[section.name], f"dflash_run.{section.name}")
            except ConfigError as e:
                return str(e)
            continue
        if not isinstance(got, dict):
            return f"dflash_run.{section.name}={str(got)[:60]!r}: expected a mapping"
        hints = typing.get_type_hints(type(getattr(Config(), section.name)))
        for key, value in got.items():
            if key not in hints or value is None:
                continue
            if hints[key] is str and not isinstance(value, str):  # dumps wrote a string: 5 is an edit
                return f"dflash_run.{section.name}.{key}={str(value)[:80]!r}: expected a string"
            try:
                _coerce(value, hints[key], f"dflash_run.{section.name}.{key}")
            except ConfigError as e:
                return str(e)
    return None


def _yaml(text: str, where: str, what: str = "valid YAML"):
    """YAML from the user (a config file, a --set value), aliases bounded (inputs.yaml_load):
    a malformed document, an alias bomb or a document nested too deeply is one line."""
    from .preflight.inputs import YAMLDuplicateKey, YAMLTooLarge, yaml_load

    try:
        return yaml_load(text)
    except YAMLDuplicateKey as e:
        raise ConfigError(f"{where}: {e}") from None
    except YAMLTooLarge as e:
        raise ConfigError(f"{where}: refused ({e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not {what} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _set(cfg, dotted: str, value, *, from_text: bool):
    obj, parts = cfg, dotted.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(type(obj))
        if part not in hints:
            where = ".".join(parts[:i]) or "config"
            known = ", ".join(sorted(hints))
            raise ConfigError(f"unknown config key {dotted!r} ({where} has: {known})")
        if i == len(parts) - 1:
            typ = hints[part]
            if dataclasses.is_dataclass(typ):
                if not isinstance(value, dict):
                    raise ConfigError(f"{dotted}={value!r}: expected a section (mapping)")
                for k, v in value.items():
                    _set(cfg, f"{dotted}.{k}", v, from_text=from_text)
                return
            if from_text and typ not in (str,) and isinstance(value, str) and typing.get_origin(typ) is None:
                value = _yaml(value, f"{dotted}={_short(value)}") if value.strip() else value
            setattr(obj, part, _coerce(value, typ, dotted))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"unknown config key {dotted!r} ({'.'.join(parts[:i + 1])} is not a section)")


def load_config(path: str | None = None, overrides: list[str] = (), *, asked: dict | None = None,
                **flags) -> Config:
    """Build and validate the config. flags are dotted keys from dedicated CLI options.
    ``asked``, when given, gets the dotted keys the file and the --set items named, with the
    values they gave (what `--init-from DIR` then replaces is said, not silent)."""
    cfg = Config()
    if path:
        from .preflight.inputs import read_text_file

        text = read_text_file(path, f"config file {path!r}", "a YAML file", ConfigError)
        data = _yaml(text, f"config file {path!r}") or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r}: expected a mapping at top level")
        leaves: dict = {}  # `train.steps:` and `train: {steps:}` in one file: the same key twice
        for k, v in data.items():
            if not isinstance(k, str):
                raise ConfigError(f"config file {path!r}: key {k!r} is not a name (expected e.g. train: or train.lr:)")
            for leaf in _leaves(k, v):
                if leaf in leaves:
                    raise ConfigError(f"config file {path!r}: {leaf} is given twice (as {leaves[leaf]!r} and as "
                                      f"{k!r}); give it once")
                leaves[leaf] = k
            _set(cfg, k, v, from_text=False)
        if asked is not None:
            asked.update({leaf: _get(cfg, leaf) for leaf in leaves})
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        k, v = item.split("=", 1)
        _set(cfg, k.strip(), v, from_text=True)
        if asked is not None:
            asked.update({leaf: _get(cfg, leaf) for leaf in _leaves(k.strip(), None)})
    for k, v in flags.items():
        if v is not None:
            _set(cfg, k, v, from_text=False)
    validate(cfg)
    return cfg


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def _leaves(key: str, value) -> list[str]:
    """The dotted keys a file's entry sets: `train: {steps: 3}` sets train.steps."""
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)] or [key]
    return [key]


def override(cfg: Config, **flags) -> Config:
    """A copy of a loaded config with more dotted keys set, validated again: what
    `load_config(..., **flags)` with them among its flags gives, without reading the files
    again (`dflash train --features`: the capture's settings replace the asked ones)."""
    cfg = copy.deepcopy(cfg)
    for k, v in flags.items():
        if v is not None:
            _set(cfg, k, v, from_text=False)
    validate(cfg)
    return cfg


# -- pipeline.layout ------------------------------------------------------------------------
# the string's format; what it means for ranks and batches is run/roles/layout.py's Layout
TARGET, DRAFTER = "target", "drafter"


class LayoutError(ConfigError):
    """A layout string that cannot be run; the message names the value."""


def parse_layout(text: str) -> tuple[int, int]:
    """'target:5,drafter:3' (either order, spaces allowed) -> (target ranks, drafter ranks)."""
    counts: dict[str, int] = {}
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        role, sep, n = part.partition(":")
        role = role.strip()
        if not sep or role not in (TARGET, DRAFTER) or role in counts:
            raise LayoutError(f"pipeline.layout={text!r}: expected 'target:N,drafter:M' "
                              f"(each role once, N and M positive integers)")
        try:
            counts[role] = int(n)
        except ValueError:
            raise LayoutError(f"pipeline.layout={text!r}: {n.strip()!r} is not an integer") from None
        if counts[role] < 1:
            raise LayoutError(f"pipeline.layout={text!r}: each role needs at least one rank")
    if set(counts) != {TARGET, DRAFTER}:
        raise LayoutError(f"pipeline.layout={text!r}: expected 'target:N,drafter:M' with both roles")
    return counts[TARGET], counts[DRAFTER]


# the paired verdict's turn (engine/paired.py): long enough that the signals and /proc reads around a
# turn are a rounding error of it (tens of microseconds), and that what a resumed engine finds cold in
# the CPU costs nothing measurable (from 50 ms: docs/serving.md); 0 asks whole requests
MIN_TURN_MS, MAX_TURN_MS = 5.0, 10_000.0


def turn_error(ms, name: str) -> str | None:
    """Why `ms` is not a turn length for the paired verdict, in one line naming `name`, or None."""
    if ms == 0 or (isinstance(ms, (int, float)) and MIN_TURN_MS <= ms <= MAX_TURN_MS):  # nan fails both
        return None
    return (f"{name}={ms}: expected 0 (whole requests, one engine after another) or "
            f"{MIN_TURN_MS:g}..{MAX_TURN_MS:g} ms (engines in turns)")


# -- ranges ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Range:
    """What a numeric value may be: finite, within [lo, hi] (or (lo, ...) when lo_open)."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""                       # what a special value means, e.g. "0: only at the end"

    def describe(self, typ) -> str:
        kind = "an integer" if typ is int else "a finite number"
        shown = (lambda v: str(v)) if typ is int else (lambda v: f"{v:g}")  # 2**64-1 exactly, not 1.8e+19
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {shown(self.lo)}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {shown(self.hi)}")
        return f"{kind} {' and '.join(parts)}".strip() + (f" ({self.note})" if self.note else "")

    def holds(self, v) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)


MAX_NEW_TOKENS = 1 << 20  # more than any target's context: a larger ask is a typo, not a plan
MAX_TOKENS = MAX_NEW_TOKENS  # any length in tokens (a sequence, a prompt, anchors), for the same reason
MAX_SEED = 2**64 - 1  # torch.manual_seed takes 0..2**64-1; seeds derived from it wrap (`derived_seed`)
MAX_LAYERS = 1024     # target layers to fuse, before the target's own count is known
MAX_STEPS = 10**9     # a step number or count: a torch int64 and a progress bar take it
MAX_DELAY_S = 3600.0  # a delay or an interval: an hour is already a test that never ends
MIN_TEMPERATURE = 1e-6  # sampling: 0 (greedy) or at least this (check_sampling)

# Every int and float in the tree has a rule here (a test checks that none is missing).
# Lists and mappings are checked element by element.
RANGES: dict[str, Range] = {
    "model.target_seed": Range(0, MAX_SEED),
    "model.num_layers": Range(*DRAFTER_LAYERS, note="drafter layers; published drafters have 1-8"),
    "model.block_size": Range(*BLOCK_SIZES),
    "model.num_target_layers": Range(1, MAX_LAYERS, note="at most the target's layers"),
    "model.target_layer_ids": Range(0, MAX_LAYERS - 1, note="decoder layer indices of the target"),
    "data.num_conversations": Range(2),
    "data.max_samples": Range(0, note="0: all"),
    "data.max_len": Range(5, MAX_TOKENS),
    "data.regen_max_new_tokens": Range(1, MAX_NEW_TOKENS),
    "data.regen_max_prompt_len": Range(1, MAX_TOKENS),
    "data.regen_batch_size": Range(0, 4096, note="0: auto"),
    "data.regen_workers": Range(0, 256, note="0: auto"),
    "data.eval_fraction": Range(0, 1, lo_open=True, hi_open=True),
    "train.steps": Range(0, MAX_STEPS),
    "train.batch_size": Range(1, 65536),
    "train.num_anchors": Range(1, MAX_TOKENS),
    "train.lr": Range(0, 1, lo_open=True),
    "train.warmup_ratio": Range(0, 1, hi_open=True),
    "train.loss_gamma": Range(0, note="0: by block size"),
    "train.weight_decay": Range(0, 10),
    "train.grad_clip": Range(0, lo_open=True),
    "train.seed": Range(0, MAX_SEED),
    "train.save_every": Range(0, MAX_STEPS, note="0: only at the end"),
    "train.stop_after": Range(0, MAX_STEPS, note="0: never"),
    "train.estimate_every": Range(0, MAX_STEPS, note="0: off"),
    "train.estimate_samples": Range(1),
    "train.loss_vocab": Range(0, 1 << 23, note="0: the whole vocabulary"),
    "model.draft_vocab": Range(0, 1 << 23, note="0: the whole vocabulary"),
    "model.sliding_window": Range(0, MAX_SLIDING_WINDOW, note="0: no sliding layers"),
    # each drafter family's own fields: their bounds are the family's (dflash/family/)
    **{k: Range(b.lo, b.hi, lo_open=b.lo_open, note=b.note) for k, b in family.config_bounds().items()},
    "train.kl_topk": Range(0, 1 << 23, note="0: the whole distribution"),
    "train.dpace_alpha": Range(0, 1, lo_open=True),
    "train.lk_eta": Range(0, 1000),
    "train.loss_chunk": Range(-1, 1 << 30, note="0: auto; -1: off"),
    "train.muon_lr": Range(0, 1, note="0: train.lr"),
    "train.muon_momentum": Range(0, 1, hi_open=True),
    "train.muon_weight_decay": Range(0, 10),
    "eval.prompts": Range(1),
    "eval.max_new_tokens": Range(1, MAX_NEW_TOKENS),
    "eval.engine_prompts": Range(0, note="0: all the eval's prompts"),
    "eval.engine_rounds": Range(1, 100),
    "eval.engine_turn_ms": Range(0, MAX_TURN_MS, note="0: whole requests, one engine after another; else >= 5"),
    "eval.max_prompt_len": Range(1, MAX_TOKENS),
    "eval.temperature": Range(0, 100, note="0: greedy"),
    "eval.top_p": Range(0, 1, lo_open=True),
    "eval.top_k": Range(0, 1 << 23, note="0: off"),
    "pipeline.queue_size": Range(1, 1024),
    "pipeline.min_ready": Range(1),
    "pipeline.prefetch": Range(1, 1024),
    "pipeline.stall_threshold_s": Range(0, MAX_DELAY_S),
    "pipeline.rank_timeout_s": Range(0, 7 * 86400, lo_open=True),
    "pipeline.inject_delay": Range(0, MAX_DELAY_S, note="seconds"),
    "pipeline.inject_fault": Range(0, MAX_STEPS, note="a step"),
    "telemetry.console_interval_s": Range(0, 86400, note="0: profile table only at the end"),
}


def derived_seed(seed: int, offset: int) -> int:
    """A seed made from a user's seed (prompt i: seed + i), kept in torch's range by wrapping."""
    return (seed + offset) % (MAX_SEED + 1)


def numeric_fields(cfg=None, prefix: str = ""):
    """(dotted key, scalar type) of every int/float leaf, list of ints/floats and mapping to
    ints/floats in the tree: what RANGES must cover."""
    cls = type(cfg) if cfg is not None else Config
    for name, typ in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(typ):
            yield from numeric_fields(typ(), key + ".")
            continue
        args = typing.get_args(typ)
        scalar = typ if typ in (int, float) else (args[-1] if args and args[-1] in (int, float) else None)
        if scalar is not None and typ is not bool:
            yield key, scalar


def _check_ranges(cfg: Config) -> None:
    for key, scalar in numeric_fields():
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        rng = RANGES[key]
        items = obj.items() if isinstance(obj, dict) else ((None, v) for v in obj) if isinstance(obj, list) \
            else ((None, obj),)
        for sub, v in items:
            if not rng.holds(v):
                shown = f"{key}.{sub}" if sub is not None else key
                raise ConfigError(f"{shown}={v!r}: expected {rng.describe(scalar)}")


LAYER_TYPES = ("sliding_attention", "full_attention")


def check_layer_types(m: ModelConfig) -> None:
    """model.layer_types / model.sliding_window: one clear line naming the value."""
    bad = [t for t in m.layer_types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"model.layer_types: {bad[0]!r}: expected sliding_attention or full_attention")
    if m.layer_types and len(m.layer_types) != m.num_layers:
        raise ConfigError(f"model.layer_types={m.layer_types}: {len(m.layer_types)} entries for "
                          f"model.num_layers={m.num_layers} (one per drafter layer)")
    sliding = "sliding_attention" in m.layer_types
    if sliding and m.sliding_window < 1:
        raise ConfigError(f"model.sliding_window={m.sliding_window}: expected >= 1 with sliding_attention in "
                          f"model.layer_types")
    if m.sliding_window and not sliding:
        raise ConfigError(f"model.sliding_window={m.sliding_window} without a sliding_attention layer in "
                          f"model.layer_types (e.g. --set model.layer_types=sliding_attention)")


def regenerates(cfg: Config) -> bool:
    """Whether the run trains on the target's own replies (data.regenerate; auto: on for the
    tiny random targets, whose replies are all they can be trained on)."""
    if cfg.data.regenerate == "auto":
        return cfg.model.target.startswith("tiny-")
    return cfg.data.regenerate == "on"


def check_regen_lengths(cfg: Config) -> None:
    """A run that trains on regenerated replies (train, capture; not one that reads a capture's
    features): a sample's loss tokens are its one reply (and the turn's end token or two), so
    under 2 x block_size every sample would be dropped, after the target loaded and regenerated.
    Checked by the commands once `--features` is known, not by validate (eval reads these
    settings too, and regenerates nothing)."""
    d, m = cfg.data, cfg.model
    if regenerates(cfg) and not d.features and d.regen_max_new_tokens + 2 < 2 * m.block_size:
        raise ConfigError(f"data.regen_max_new_tokens={d.regen_max_new_tokens} with model.block_size={m.block_size}: "
                          f"every regenerated reply would be too short to train on (a sample needs "
                          f"{2 * m.block_size} reply tokens); raise data.regen_max_new_tokens to at least "
                          f"{2 * m.block_size} or lower model.block_size")


def validate(cfg: Config) -> None:
    """Range checks and cheap existence checks. Nothing heavy is loaded and nothing here
    imports torch or transformers (they take seconds): bad input fails in milliseconds."""
    from .data import chat_template
    from .preflight import inputs

    m, d, p = cfg.model, cfg.data, cfg.pipeline
    if cfg.eval.baseline not in ("prompt_lookup", "none"):
        raise ConfigError(f"eval.baseline={cfg.eval.baseline!r}: expected prompt_lookup or none")
    if m.draft_vocab and m.copy_head:
        raise ConfigError("model.draft_vocab with model.copy_head=true: a copy may propose any token, a draft "
                          "vocabulary only its own; choose one")
    if m.arch not in family.NAMES:
        raise ConfigError(f"model.arch={m.arch!r}: expected {_one_of(family.NAMES)}")
    err = family.get(m.arch).check(m, cfg.train)
    if err:
        raise ConfigError(err)
    if cfg.eval.engine not in ("none", "auto", "vllm"):
        raise ConfigError(f"eval.engine={cfg.eval.engine!r}: expected none, auto or vllm")
    _check_ranges(cfg)
    if err := turn_error(cfg.eval.engine_turn_ms, "eval.engine_turn_ms"):
        raise ConfigError(err)
    check_sampling(cfg.eval.temperature, cfg.eval.top_p, cfg.eval.top_k, prefix="eval.")
    check_layer_types(m)
    if m.drafter_init not in ("random", "target"):
        raise ConfigError(f"model.drafter_init={m.drafter_init!r}: expected random or target")
    if m.dtype == "float16":  # refused, not half-supported: see docs/gpu.md "Precision"
        raise ConfigError("model.dtype=float16: not supported (fp16 needs loss scaling, which this trainer "
                          "does not do, and bf16-trained targets can overflow in fp16); use bfloat16")
    if m.dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"model.dtype={m.dtype!r}: expected auto, float32 or bfloat16")
    if d.max_len < 2 * m.block_size + 1:
        raise ConfigError(f"data.max_len={d.max_len}: expected > 2*block_size ({2 * m.block_size})")
    t = cfg.train
    if t.loss not in LOSSES:
        raise ConfigError(f"train.loss={t.loss!r}: expected {_one_of(LOSSES)}")
    if t.loss_weights not in WEIGHTINGS:
        raise ConfigError(f"train.loss_weights={t.loss_weights!r}: expected {_one_of(WEIGHTINGS)}")
    if t.optimizer not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer={t.optimizer!r}: expected {_one_of(OPTIMIZERS)}")
    if t.muon_adjust_lr not in MUON_LR_RULES:
        raise ConfigError(f"train.muon_adjust_lr={t.muon_adjust_lr!r}: expected {_one_of(MUON_LR_RULES)}")
    if cfg.eval.confidence_threshold and not ("confidence_head" in family.get(m.arch).model_names
                                              and m.confidence_head):
        raise ConfigError(f"eval.confidence_threshold={cfg.eval.confidence_threshold}: our decoder gates drafting "
                          "by a confidence head; train one (model.arch=dspark, model.confidence_head=true)")
    if t.attention not in ATTENTIONS:
        raise ConfigError(f"train.attention={t.attention!r}: expected {_one_of(ATTENTIONS)}")
    if t.attention == "flex" and not all(str(d).startswith("cuda") for d in p.drafter_devices):
        raise ConfigError(f"train.attention=flex with pipeline.drafter_devices={p.drafter_devices}: flex needs a CUDA "
                          "drafter device (torch has no flex_attention backward on the CPU); use sdpa")
    if d.regen_engine not in ("hf", "vllm"):
        raise ConfigError(f"data.regen_engine={d.regen_engine!r}: expected hf or vllm")
    if d.regenerate not in ("auto", "on", "off"):
        raise ConfigError(f"data.regenerate={d.regenerate!r}: expected auto, on or off")
    if d.long_samples not in ("cut", "split"):
        raise ConfigError(f"data.long_samples={d.long_samples!r}: expected cut or split")
    if d.features:
        _check_features(cfg)
    if p.layout:
        parse_layout(p.layout)
        if cfg.train.estimate_every:
            raise ConfigError(f"train.estimate_every={cfg.train.estimate_every} with pipeline.layout={p.layout!r}: "
                              "no rank holds both the target and the drafter; set train.estimate_every=0")
        if cfg.train.feature_cache:
            raise ConfigError(f"train.feature_cache=true with pipeline.layout={p.layout!r}: the cache lives with "
                              "the drafter's own target, which a layout's target ranks do not use")
        if p.handoff not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"pipeline.handoff={p.handoff!r}: expected auto, nccl or gloo")
        if p.handoff == "nccl" and not all(d.startswith("cuda") for d in p.target_devices + p.drafter_devices):
            raise ConfigError(f"pipeline.handoff=nccl: expected every target and drafter device on CUDA "
                              f"(got {p.target_devices} / {p.drafter_devices})")
    if p.queue_size < 1 or not 1 <= p.min_ready <= p.queue_size:
        raise ConfigError(f"pipeline.min_ready={p.min_ready}, queue_size={p.queue_size}: expected 1 <= min_ready <= queue_size")
    for name, devs in (("target_devices", p.target_devices), ("drafter_devices", p.drafter_devices)):
        if (not devs and not p.layout) or any(not str(d).strip() for d in devs):
            raise ConfigError(f"pipeline.{name}={devs}: expected a comma list of devices (cpu, cuda[:N]), "
                              f"with no empty entry")
    for dev in p.target_devices + p.drafter_devices:
        if dev != "cpu" and not dev.startswith("cuda"):
            raise ConfigError(f"device {dev!r}: expected cpu or cuda[:N]")
    if any(d.startswith("cuda") for d in p.target_devices) and not all(
            d.startswith("cuda") for d in p.drafter_devices):
        raise ConfigError(f"pipeline.drafter_devices={p.drafter_devices}: expected CUDA devices when a target is on "
                          f"CUDA (a CPU drafter would have to wait on the GPU from the host)")
    from .phases import INJECTABLE
    for stage, secs in p.inject_delay.items():
        name, at, rank = stage.partition("@")
        if name in INJECTABLE and (not at or rank.isdigit()):
            continue  # a set-up phase, on every rank or on one (dflash/phases.py)
        if stage not in STAGES:
            raise ConfigError(f"--inject-delay {stage}={secs}: unknown stage (expected one of {', '.join(STAGES)}, "
                              f"or a set-up phase {', '.join(INJECTABLE)}, optionally PHASE@RANK)")
    for stage, step in p.inject_fault.items():
        if stage not in STAGES:
            raise ConfigError(f"--inject-fault {stage}={step}: unknown stage (expected one of {', '.join(STAGES)})")
    if cfg.telemetry.mode not in ("process", "thread"):
        raise ConfigError(f"telemetry.mode={cfg.telemetry.mode!r}: expected process or thread")
    cfg.telemetry.trackers = check_trackers(cfg.telemetry.trackers, "telemetry.trackers=")
    if m.init_from and not os.path.isfile(os.path.join(m.init_from, "config.json")):
        raise ConfigError(f"model.init_from={m.init_from!r}: no config.json there (expected a DFlash drafter dir)")
    inputs.check_target_spec(m.target)
    inputs.check_cache_dir()  # a file named by DFLASH_CACHE: one line now, not NotADirectoryError later
    if d.path:
        inputs.check_dataset_path(d.path)
    chat_template.check(d.chat_template, d.chat_template_kwargs)
    layers = inputs.target_num_layers(m.target)
    # the layer count is known without loading the model for tiny targets, smollm2, a local dir
    if len(set(m.target_layer_ids)) != len(m.target_layer_ids):  # the same layer fused twice: a wider fc, no more
        raise ConfigError(f"model.target_layer_ids={m.target_layer_ids}: expected distinct layer ids")
    if layers is not None and m.target_layer_ids and max(m.target_layer_ids) >= layers:
        raise ConfigError(f"model.target_layer_ids={m.target_layer_ids}: expected ids < {layers} "
                          f"(target {m.target!r} has {layers} decoder layers)")
    if layers is not None and not m.target_layer_ids and m.num_target_layers > layers:
        from .preflight.layer_ids import num_target_layers_error
        raise ConfigError(num_target_layers_error(m.num_target_layers, layers))


def _check_features(cfg: Config) -> None:
    """`data.features`: what training from a capture cannot do (it has no target to run)."""
    p, where = cfg.pipeline, f"data.features={cfg.data.features!r}"
    if p.layout:
        raise ConfigError(f"{where} with pipeline.layout={p.layout!r}: no target ranks are needed; launch the "
                          "drafter ranks alone (torchrun --nproc_per_node N, no --layout)")


def check_trackers(names: list[str], where: str = "--tracker ") -> list[str]:
    """Tracker names (wandb, tensorboard, mlflow), each once; returns them in order.
    `where`: how the user wrote them, e.g. "--tracker " or "telemetry.trackers=". """
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ConfigError(f"{where}{','.join(names)}: unknown tracker {bad[0]!r} "
                          f"(expected a comma list of {', '.join(TRACKERS)})")
    return list(dict.fromkeys(names))


def check_sampling(temperature: float, top_p: float, top_k: int, prefix: str = "--") -> None:
    """Sampling settings: finite, temperature >= 0, 0 < top_p <= 1, top_k >= 0."""
    import math

    sep = "_" if prefix == "eval." else "-"
    for name, v in (("temperature", temperature), (f"top{sep}p", top_p)):
        if not math.isfinite(v):
            raise ConfigError(f"{prefix}{name}={v}: expected a finite number")
    # logits / T overflows float32 below ~1e-37 (NaN probabilities); above 100 it is noise
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE or temperature > 100:
        raise ConfigError(f"{prefix}temperature={temperature}: expected 0 (greedy) or a number in "
                          f"[{MIN_TEMPERATURE:g}, 100]")
    if not 0 < top_p <= 1:
        raise ConfigError(f"{prefix}top{sep}p={top_p}: expected 0 < x <= 1")
    if top_k < 0:
        raise ConfigError(f"{prefix}top{sep}k={top_k}: expected an integer >= 0 (0: off)")


def _one_of(names) -> str:
    """("a", "b", "c") -> "a, b or c"."""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def resolve_dtype(cfg: Config, device: str):
    import torch

    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, cfg.model.dtype)


def local_device(dev: str) -> str:
    """Plain `cuda` means this rank's GPU (LOCAL_RANK, torchrun's convention)."""
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if dev == "cuda" else dev


def dumps(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def dump(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(dumps(cfg))


def check_walked_eval(cfg: Config) -> None:
    """`train --eval` with eval.decode=false scores the drafter by the estimate's walk: it needs
    the estimate on the eval's prompts, greedy. Checked only where that eval runs (a run
    without --eval, or a bench that turns the estimate off, leaves eval.* unused)."""
    e = cfg.eval
    if e.decode:
        return
    if not cfg.train.estimate_every:
        raise ConfigError("eval.decode=false walks the held-out prompts the estimate walks: set "
                          "train.estimate_every (e.g. to train.steps)")
    if cfg.train.estimate_samples < e.prompts:
        raise ConfigError(f"eval.decode=false with eval.prompts={e.prompts}: the walk covers "
                          f"train.estimate_samples={cfg.train.estimate_samples} prompts; raise it to {e.prompts}")
    if e.temperature:
        raise ConfigError(f"eval.decode=false with eval.temperature={e.temperature}: the walk is greedy; "
                          "decode to sample (eval.decode=true)")
    if e.confidence_threshold:
        raise ConfigError(f"eval.decode=false with eval.confidence_threshold={e.confidence_threshold}: the walk "
                          "drafts whole blocks; decode to gate drafting (eval.decode=true)")
