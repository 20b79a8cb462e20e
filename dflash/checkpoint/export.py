"""`dflash export`: write a trained drafter in the format SGLang, vLLM and the reference read.

The format itself (names, config keys) is export_format.py; this file writes a
directory in it: config.json, model.safetensors and a README.md that says what the
drafter is for and how to serve it. The copy head (model/copy_head.py) has no place in
the format: exporting a drafter that has one is refused unless the user asks for the
rest without it (what an engine would then run).

Also called at the end of every `dflash train` (`export_after_run`): what a run leaves
behind can be served as it is.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import ConfigError
from ..preflight import checkpoint_files as files
from . import export_format as fmt

DTYPES = ("bfloat16", "float32")


def check_request(checkpoint: str, out: str, *, without_copy_head: bool, overwrite: bool = False) -> dict:
    """Torch-free checks of `dflash export`'s arguments; returns the checkpoint's config.json.

    --out is written only when it is new or empty, or holds an earlier `dflash export`
    (its `.dflash-export` marker, nothing else beside it) and --overwrite says to replace it.
    A drafter someone else wrote (a SpecForge export, a downloaded one: the same layout,
    no marker) is never replaced, with or without --overwrite."""
    try:  # a kill between a save's two renames leaves only RUN/checkpoint.old: read it, as resume and eval do
        where = files.resolve(checkpoint)
    except files.CheckpointError:
        where = Path(checkpoint)
    raw = fmt.read_config(where)
    if raw is None:
        raise ConfigError(f"--checkpoint {checkpoint!r}: no config.json there (expected RUN/checkpoint from dflash train)")
    if fmt.is_export_config(raw):
        raise ConfigError(f"--checkpoint {checkpoint!r}: already in the served DFlash format (nothing to export)")
    if raw.get("copy_head") and not without_copy_head:
        raise ConfigError(f"--checkpoint {checkpoint!r}: the drafter has a copy head (model.copy_head), which the "
                          f"DFlash format cannot carry; add --without-copy-head to export the rest")
    files.check_readable(checkpoint)  # whole, within bounds, every weight finite: before torch loads it
    from ..config import run_config_error
    err = run_config_error(raw.get("dflash_run") or {})
    if err:
        raise ConfigError(f"--checkpoint {checkpoint!r}: config.json: {err}")
    target = ((raw.get("dflash_run") or {}).get("model") or {}).get("target") or raw.get("target")
    if target:  # its config is read for the export: a hub id that cannot be reached is one line now, not retries
        from ..preflight.inputs import TargetSpecError, check_target_spec
        try:
            check_target_spec(target, probe_hub=True)
        except TargetSpecError as e:
            raise ConfigError(f"--checkpoint {checkpoint!r}: its target: {e}") from None
    from ..preflight.run_dir import check_place

    dst = check_place(out, expected="a new or empty dir, or an earlier dflash export")
    if dst.is_symlink():  # the export is renamed into place: the link itself would be replaced, its target left empty
        raise ConfigError(f"--out {out!r}: a symbolic link (to {os.readlink(dst)!r}); the export is renamed into "
                          f"place and would replace the link: name the directory itself")
    _check_not_in_a_runs_own_dirs(out, dst)
    if dst.is_dir() and any(dst.iterdir()):
        foreign = files.foreign_entries(dst, files.EXPORT_WRITTEN)
        if not (dst / files.EXPORT_MARKER).is_file():
            what = "a drafter that dflash export did not write" if (dst / files.CONFIG).is_file() else "files"
            shown = ", ".join(sorted(e.name for e in dst.iterdir())[:3])
            raise ConfigError(f"--out {out!r}: holds {what} ({shown}); dflash export never replaces it: "
                              "choose a new or empty directory")
        if foreign:
            raise ConfigError(f"--out {out!r}: an earlier dflash export, but it also holds files dflash did not "
                              f"write ({', '.join(foreign[:3])}); move them out or choose a new directory")
        if not overwrite:
            raise ConfigError(f"--out {out!r}: holds an earlier dflash export; pass --overwrite to replace it")
    return raw


# a run's dirs that only the run writes: an export inside one would stop its next --resume ("holds files
# dflash did not write") or be mixed with its spans
_RUNS_OWN = ("checkpoint", "checkpoint.old", "telemetry", "engine", "best", "ranks")


def _check_not_in_a_runs_own_dirs(out: str, dst: Path) -> None:
    from ..preflight.run_dir import is_run_dir

    where = dst.resolve()  # through links: a link to a run's checkpoint/ is that checkpoint/
    for inner in (where, *where.parents):
        if inner.name in _RUNS_OWN and is_run_dir(inner.parent):
            raise ConfigError(f"--out {out!r}: inside the {inner.name}/ of the run in {str(inner.parent)!r}, "
                              f"which only that run writes; choose a place outside it (its own export/ is "
                              f"{str(inner.parent / 'export')!r})")


def serve_commands(target: str, out: Path, block_size: int) -> dict:
    """The engines' command lines, every word quoted for a shell (a path can hold anything)."""
    out = str(Path(out).resolve())
    spec = json.dumps({"method": "dflash", "model": out, "num_speculative_tokens": block_size - 1})
    return {
        "sglang": shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target,
                              "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", out,
                              "--speculative-num-draft-tokens", str(block_size)]),
        "vllm": shlex.join(["vllm", "serve", target, "--speculative-config", spec]),
    }


def _eval_lines(figures: dict | None) -> list[str]:
    if not figures:
        return ["Not measured. Measure it with `dflash eval --checkpoint DIR --target TARGET`."]
    out = []
    for label, res in figures.items():
        if not isinstance(res, dict) or "acceptance_length" not in res:
            continue
        temp = res.get("temperature", 0.0)
        base = res.get("baseline") or {}
        step = f"{res['tau_per_step']:.3f} per verify step, " if "tau_per_step" in res else ""
        out.append(f"- {label}: tau {step}{res['acceptance_length']:.3f} per-prompt mean over {res.get('prompts')} prompts "
                   f"(block {res.get('block_size')}, T={temp}, {res.get('dtype', '?')}, "
                   f"lossless={res.get('lossless')})"
                   + (f"; prompt lookup on the same prompts: tau "
                      + (f"{base['tau_per_step']:.3f} per verify step, " if "tau_per_step" in base else "")
                      + f"{base['acceptance_length']:.3f} per-prompt mean" if "acceptance_length" in base else "")
                   + (" [partial: the eval was interrupted]" if res.get("interrupted") else ""))
    return out or ["Not measured."]


# the embedded default is a dequantized Q4_1 GGUF of this model: the closest thing an engine loads
_SERVED_AS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def readme(dcfg, *, target: str, out: Path, dtype: str, figures: dict | None, note: str | None) -> str:
    served = _SERVED_AS.get(target, target)
    cmds = serve_commands(served, out, dcfg.block_size)
    if served != target:
        servable = (f"\n(`{target}` is the Q4_1 GGUF of `{served}`, dequantized: the drafter trained on that; "
                    f"the full-precision model drafts alike but not identically.)\n")
    elif "/" in target or os.path.isdir(target):
        servable = ""
    else:
        servable = (f"\n(`{target}` is one of this trainer's built-in targets, not a model an engine can load: "
                    f"the commands show the shape only.)\n")
    return "\n".join([
        "# DFlash drafter",
        "",
        f"Trained by dflash-otel for the target `{target}`. Served format: z-lab's DFlash layout "
        f"(`DFlashDraftModel`), read by SGLang, vLLM and the reference `dflash` package.",
        "",
        f"- block size: {dcfg.block_size} (vLLM `num_speculative_tokens` = {dcfg.block_size - 1})",
        f"- mask token id: {dcfg.mask_token_id}",
        f"- drafter layers: {dcfg.num_hidden_layers}; target layers fused: {dcfg.target_layer_ids} "
        f"(id i = output of decoder layer i = `hidden_states[i + 1]`)",
        f"- weights: {dtype}; no embedding and no lm_head (the target's are used)",
        *([f"- note: {note}"] if note else []),
        "",
        "## Acceptance length (tau)",
        "",
        *_eval_lines(figures),
        "",
        "## Serve it",
        servable,
        "SGLang:",
        "",
        f"    {cmds['sglang']}",
        "",
        "vLLM:",
        "",
        f"    {cmds['vllm']}",
        "",
        "Compare against another drafter on your prompts:",
        "",
        f"    dflash eval --target {shlex.quote(str(target))} --checkpoint {shlex.quote(str(Path(out).resolve()))} "
        "--checkpoint OTHER_DIR",
        "",
    ])


def served_drafter(drafter, device, dtype: str = "bfloat16"):
    """A copy of `drafter` exactly as `dflash eval --checkpoint EXPORT` reads an export of it in
    `dtype`: weights rounded to that dtype (back in float32 master weights), no copy head.
    The after-training eval scores this one: the figure is the served drafter's."""
    import copy

    import torch

    served = copy.deepcopy(drafter).to(device)
    served.use_copy = False
    with torch.no_grad():
        for name, p in served.named_parameters():
            if not name.startswith("copy."):
                p.copy_(p.to(getattr(torch, dtype)).float())
        if getattr(served, "draft_head", None) is not None:  # a draft vocabulary's head travels in dtype too
            served.draft_head.copy_(served.draft_head.to(getattr(torch, dtype)).float())
    return served


def held_out_prompts(cfg, eval_convs, run_dir) -> tuple[list, dict] | None:
    """The run's held-out prompts (their first turn, uncut: eval cuts them to eval.max_prompt_len
    as it cuts the run's own) and the settings they are scored with, for an export to carry:
    `dflash eval --checkpoint EXPORT` then scores it on the same prompt ids as the run checkpoint.
    None when the run held none out (trained from captured features)."""
    import dataclasses

    from ..data.prompt_sets import first_turns

    if not eval_convs:
        return None
    settings = {
        "about": (f"the held-out prompts of the run {run_dir} ({files.EVAL_PROMPTS}: system prompt and first user "
                  "turn of each held-out conversation, in the order its eval takes them) and the eval settings "
                  "it scored them with; `dflash eval --checkpoint THIS_DIR` uses both"),
        "prompts": files.EVAL_PROMPTS,
        "model": {"target": cfg.model.target, "target_seed": cfg.model.target_seed},
        "eval": dataclasses.asdict(cfg.eval),
        "data": dataclasses.asdict(cfg.data),  # what the run trained on: eval warns when prompts overlap it
        "seed": cfg.train.seed,
    }
    return first_turns(eval_convs), settings


def _run_held_out(run_cfg: dict, run_dir: Path):
    """`dflash export` of a run checkpoint: its held-out prompts again, from its config (never fatal)."""
    if (run_cfg.get("data") or {}).get("features"):
        return None  # trained from captured features: the run held no conversations out
    try:
        from ..config import load_config
        from ..prep.prepare import split

        cfg = load_config(None, [], **{k: run_cfg[k] for k in ("model", "data", "eval") if k in run_cfg},
                          **{"train.seed": (run_cfg.get("train") or {}).get("seed", 0), "model.init_from": ""})
        return held_out_prompts(cfg, split(cfg)[1], run_dir)
    except Exception as e:
        print(f"dflash export: the run's held-out prompts are not carried ({type(e).__name__}: {e}); "
              f"dflash eval of the export will say where its prompts come from", file=sys.stderr)
        return None


def write_export(drafter, target_config, out: str | Path, *, dtype: str = "bfloat16", target: str = "",
                 figures: dict | None = None, note: str | None = None, prompts: tuple | None = None,
                 replace: bool = True) -> Path:
    """Write `drafter` (ours, without a copy head in use) to `out` in the served format,
    atomically (temp dir + rename, so a reader never sees half an export). `prompts`
    (`held_out_prompts`): the run's held-out prompts and eval settings, carried beside it.
    ``replace`` False (`dflash export` without --overwrite): an export another process put
    at `out` while this one was written is not replaced (two exports to one new dir).
    A full disk is one line (ConfigError), the earlier export untouched."""
    import torch
    from safetensors.torch import save_file

    dcfg = drafter.cfg
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("copy.")}
    tensors = {k: v.detach().to("cpu", getattr(torch, dtype) if v.is_floating_point() else torch.int64).contiguous()
               for k, v in fmt.export_state_dict(state).items()}
    cfg = fmt.export_config(dcfg, target_config, dtype=dtype)
    dst = Path(out)
    dst.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(dst)
    # the writer's pid in the name: a later export sweeps it once this process is gone
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-{os.getpid()}-", dir=dst.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "README.md").write_text(readme(dcfg, target=target, out=dst, dtype=dtype, figures=figures, note=note))
        if prompts is not None:
            from ..data.prompt_sets import write_jsonl
            write_jsonl(prompts[0], tmp / files.EVAL_PROMPTS)
            (tmp / files.EVAL_SETTINGS).write_text(json.dumps(prompts[1], indent=2) + "\n")
        (tmp / files.EXPORT_MARKER).write_text(json.dumps({"written_by": "dflash export", "version": 1}) + "\n")
        files.plain_modes(tmp)  # an engine running as another user must read it
        if replace:
            _swap_in(tmp, dst)
        else:  # checked new or empty before it was made: someone may have written it since
            _place_new(tmp, dst, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = _no_room(e)
        if why:
            raise ConfigError(f"--out {str(out)!r}: the export could not be written ({why}); nothing was "
                              f"replaced") from None
        raise
    return dst


def _no_room(e: BaseException) -> str | None:
    """'no space left on device' and its kin, from an OSError or a writer's own error text
    (safetensors raises its own type with the OS's words in it), else None."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return os.strerror(e.errno).lower()
    text = str(e)
    for words in ("No space left on device", "Disk quota exceeded", "Read-only file system"):
        if words in text:
            return words.lower()
    return None


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # linux/fs.h


def _renameat2(a: Path, b: Path, flags: int) -> int | None:
    """Linux renameat2: 0, or the errno it failed with; None where the platform or the C
    library has none (glibc < 2.28, musl without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd = -100
    return 0 if fn(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), flags) == 0 else ctypes.get_errno()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one step (RENAME_EXCHANGE): a reader sees the one or the other
    at each name, never neither. False where the platform, the C library or the file system
    cannot (the caller then renames aside)."""
    return _renameat2(a, b, _RENAME_EXCHANGE) == 0


def _place_new(tmp: Path, dst: Path, out) -> None:
    """``tmp`` becomes ``dst`` only where nothing is there (or the empty dir the check allowed),
    in one step: another export that landed since the check is never replaced."""
    import errno

    if dst.is_dir() and not dst.is_symlink():
        try:
            dst.rmdir()  # empty: a new name for renameat2; not empty: OSError, and the rename below refuses
        except OSError:
            pass
    err = _renameat2(tmp, dst, _RENAME_NOREPLACE)
    if err is None or err == errno.EINVAL:  # no renameat2, or a file system without NOREPLACE
        try:
            os.rename(tmp, dst)  # refuses a non-empty dir (ENOTEMPTY); a new name is taken whole
            return
        except OSError as e:
            err = e.errno
    if err in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
        raise ConfigError(f"--out {str(out)!r}: another export was written there while this one was made; "
                          f"nothing replaced (add --overwrite to replace it)")
    if err:
        raise OSError(err, os.strerror(err), str(dst))


def _swap_in(tmp: Path, dst: Path) -> None:
    """The whole new export at ``dst`` in one step, then the earlier one deleted: a kill at any
    moment leaves the earlier export or the new one there (deleting the earlier files first
    left neither, and the new one stranded in a hidden temp dir). Where the exchange is not
    available, the earlier one is renamed aside first: a moment between two renames, which
    `sweep_stale` repairs. What an export does not write is never deleted: a dir that held
    other files too is kept as DST.kept-PID."""
    if dst.is_symlink():  # a link in the export's place is removed as a link, never followed
        dst.unlink()
    if not dst.exists():
        os.replace(tmp, dst)
        return
    if dst.is_dir() and _exchange(tmp, dst):
        old = tmp  # now holds the earlier export
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-{os.getpid()}-", dir=dst.parent))
        os.replace(dst, old)  # a dir replaces an empty dir; a file at dst fails here, as before
        os.replace(tmp, dst)
    kept = files.remove_written(old, files.EXPORT_WRITTEN)  # only what an export writes
    if kept is not None:
        named = _free_name(dst.with_name(f"{dst.name}.kept-{os.getpid()}"))
        os.replace(kept, named)
        print(f"dflash: {dst} held other files too: they are kept in {named}", file=sys.stderr)


def _free_name(p: Path) -> Path:
    n, q = 0, p
    while q.exists() or q.is_symlink():
        n += 1
        q = p.with_name(f"{p.name}-{n}")
    return q


def sweep_stale(dst: Path) -> list[Path]:
    """What killed exports left beside ``dst``, once their writer (the pid in the name) is
    gone: a temp dir (a new export never swapped in, or an earlier one swapped out) is
    deleted, files an export writes only; an earlier export set aside with no export at
    ``dst`` is put back. Names an export does not make, links, and the dirs of a live writer
    are left alone. Returns what was swept."""
    import re

    name = re.compile(rf"\.{re.escape(dst.name)}\.(?P<kind>tmp|old)-(?P<pid>[0-9]+)-[^-/]+")
    swept = []
    try:
        entries = sorted(dst.parent.iterdir())
    except OSError:
        return swept
    for t in entries:
        m = name.fullmatch(t.name)
        if m is None or t.is_symlink() or not t.is_dir():
            continue
        try:
            os.kill(int(m["pid"]), 0)
            continue  # its writer lives (or the pid was reused: swept once that one ends)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):  # another user's process, or no pid at all
            continue
        if files.foreign_entries(t, files.EXPORT_WRITTEN):
            continue  # holds what no export writes: not ours to delete
        if m["kind"] == "old" and not dst.exists() and not dst.is_symlink():
            os.replace(t, dst)  # the earlier export, back where it was
        else:
            files.remove_written(t, files.EXPORT_WRITTEN)
        swept.append(t)
    return swept


def target_config(spec: str):
    """The target's config, without loading its weights (tiny targets build theirs)."""
    from ..model import target as target_mod

    if spec in target_mod.TINY_TARGETS:
        return target_mod._tiny_config(spec, target_mod.load_tokenizer(spec))
    from transformers import AutoConfig

    src = target_mod._smollm2_model_dir() if spec == target_mod.SMOLLM2 else spec
    return target_mod.from_pretrained(AutoConfig, src, f"target '{spec}'")


def run_figures(run_dir: Path) -> dict:
    """The eval figures a run recorded in summary.json (after training), if any."""
    from ..preflight.inputs import read_json

    try:
        s = read_json(run_dir / "summary.json", str(run_dir), ValueError)
    except ValueError:  # absent, too large, malformed: nothing to report
        return {}
    if not isinstance(s, dict):
        return {}
    out = {}
    if isinstance(s.get("eval_after"), dict) and "acceptance_length" in s["eval_after"]:
        served = " (the served drafter, bf16 weights)" if s["eval_after"].get("served") else ""
        out["after training" + served] = s["eval_after"]
    last = (s.get("acceptance_estimate") or {}).get("last") or {}
    if "tau_no_copy" in last:
        out["_tau_no_copy_estimate"] = last["tau_no_copy"]
    return out


def export_checkpoint(checkpoint: str, out: str, *, dtype: str = "bfloat16", without_copy_head: bool = False,
                      overwrite: bool = False) -> dict:
    """`dflash export`: a `dflash train` checkpoint -> the served format. Returns what it did."""
    raw = check_request(checkpoint, out, without_copy_head=without_copy_head, overwrite=overwrite)
    from . import checkpoint as ckpt

    drafter, run_cfg = ckpt.load_drafter(ckpt.resolve(checkpoint))
    target = (run_cfg.get("model") or {}).get("target") or raw.get("target") or ""
    tcfg = target_config(target)
    figures = run_figures(Path(checkpoint).resolve().parent)
    no_copy = figures.pop("_tau_no_copy_estimate", None)
    note = None
    if raw.get("copy_head") and not any(isinstance(f, dict) and f.get("served") for f in figures.values()):
        figures = {}  # what the run measured included the copy head's proposals
        note = ("exported without its copy head (the format has no place for it); "
                + (f"held-out acceptance estimate without it: tau {no_copy:.3f}" if no_copy is not None else
                   "tau without it: not measured"))
    warn = fmt.rope_warning(tcfg)
    if warn:
        print(f"dflash export: warning: {warn}", file=sys.stderr)
    run_dir = Path(checkpoint).resolve().parent
    dst = write_export(drafter, tcfg, out, dtype=dtype, target=target, figures=figures, note=note,
                       prompts=_run_held_out(run_cfg, run_dir), replace=overwrite)
    size = (dst / "model.safetensors").stat().st_size
    return {"out": str(dst), "dtype": dtype, "bytes": size, "target": target,
            "without_copy_head": bool(raw.get("copy_head")), "tau_no_copy_estimate": no_copy,
            "block_size": drafter.cfg.block_size}


def export_after_run(spec, drafter, summary: dict, *, dtype: str = "bfloat16", target_config=None) -> dict:
    """The end of `dflash train` (`spec`: its run/context.RunSpec): write OUT/export/ from the
    trained drafter, or say why not. Never raises: a run's result (its checkpoint) is
    already on disk; a failed export is reported, not fatal."""
    try:
        if drafter.copy is not None:
            why = ("the drafter has a copy head (model.copy_head), which the DFlash format cannot carry; export "
                   f"the rest with: dflash export --checkpoint {shlex.quote(str(spec.out / 'checkpoint'))} "
                   f"--out {shlex.quote(str(spec.out / 'export'))} "
                   "--without-copy-head")
            print(f"dflash train: no served export: {why}", file=sys.stderr)
            return {"skipped": why}
        after = summary.get("eval_after") or {}
        figures = {"after training" + (f" (the served drafter, {dtype} weights)" if after.get("served") else ""): after} \
            if "acceptance_length" in after else None
        tcfg = target_config if target_config is not None else spec.target_config
        dst = write_export(drafter, tcfg, spec.out / "export", dtype=dtype, target=spec.cfg.model.target,
                           figures=figures, prompts=held_out_prompts(spec.cfg, spec.eval_convs, spec.out))
        return {"out": str(dst), "dtype": dtype, "bytes": (dst / "model.safetensors").stat().st_size}
    except Exception as e:  # reported in summary.json and on stderr
        print(f"dflash train: export to {spec.out / 'export'} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}
