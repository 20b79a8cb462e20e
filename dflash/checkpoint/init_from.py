"""`dflash train --init-from DIR`: fine-tune a drafter someone else trained.

DIR is a served-format DFlash drafter (a published one, a SpecForge or `dflash export`
output) or a `dflash train` checkpoint. Its shape decides the run's: the number of drafter
layers, the block size, the fused target layers and the sliding-window layout come from DIR (`init_flags`, torch-free,
applied over the config before validation), its weights from `load_into_run` once the
target is loaded (a drafter that does not fit the target is one line, exit 2). Optimizer
and schedule start fresh: this is a new run from those weights, not a resume.
"""
from __future__ import annotations

from .. import family
from . import drafter_dirs


def init_flags(path: str) -> dict:
    """Config keys DIR fixes (dotted, as the CLI's flags are)."""
    d = drafter_dirs.inspect(path, flag="--init-from")
    f = drafter_dirs.fields(d)
    flags = {"model.init_from": str(d.path), "model.num_layers": int(f["num_hidden_layers"]),
             "model.block_size": int(f["block_size"]), "model.target_layer_ids": list(f["target_layer_ids"]),
             "model.layer_types": list(f.get("layer_types") or []),
             "model.sliding_window": int(f.get("sliding_window") or 0)}
    # its draft vocabulary's size, or none: a full-vocabulary DIR stays one (its head, and DSpark's
    # Markov rows, cover every token: a draft vocabulary would be new weights); one of K tokens keeps
    # K, drawn from this run's data, a DSpark's rows following their tokens (model/dspark.py)
    flags["model.draft_vocab"] = int(f.get("draft_vocab_size") or 0)
    fam = family.of(f)
    if fam.name != family.DEFAULT:  # DIR's family and its own parts' sizes (dflash/family/)
        flags["model.arch"] = fam.name
        flags.update({f"model.{k}": f[k] for k in fam.model_names})
    return flags


def say_replaced(path: str, flags: dict, asked: dict) -> None:
    """What the config asked that DIR's shape replaces (``asked``: load_config's), said in one
    line rather than silently; another family than DIR's is refused: DIR's own parts (DSpark's
    Markov head, DFlash2's selector) would be dropped, and only a DFlash DIR starts another family."""
    import sys

    if "model.arch" in flags and asked.get("model.arch", flags["model.arch"]) != flags["model.arch"]:
        raise drafter_dirs.DrafterDirError(
            f"--init-from {path!r}: a {flags['model.arch']} drafter, and model.arch={asked['model.arch']} asks for "
            f"another family; --init-from keeps DIR's ({flags['model.arch']}; a {family.DEFAULT} DIR starts any "
            f"family): leave model.arch out, or start from a {family.DEFAULT} drafter")
    replaced = [f"{k}={v!r} (asked {asked[k]!r})" for k, v in flags.items()
                if k in asked and k not in ("model.init_from", "model.arch") and asked[k] != v]
    if replaced:
        print(f"--init-from {path}: the drafter keeps its shape: {', '.join(replaced)}", file=sys.stderr)


def load_into_run(cfg, target):
    """The run's drafter, initialised from cfg.model.init_from (float32, on the CPU)."""
    from dataclasses import replace

    from ..model.architectures import make_drafter

    d = drafter_dirs.inspect(cfg.model.init_from, flag="--init-from")
    drafter_dirs.check_fits(drafter_dirs.fields(d), f"--init-from {cfg.model.init_from!r}", target=target,
                            draft_token_max=d.draft_token_max)
    # set in a YAML file rather than by --init-from, the run's shape may disagree with DIR's
    for key, want in init_flags(cfg.model.init_from).items():
        have = getattr(cfg.model, key.split(".")[1])
        if key != "model.init_from" and have != want:
            raise drafter_dirs.DrafterDirError(f"{key}={have}: model.init_from={cfg.model.init_from!r} has {want} "
                                               f"(dflash train --init-from DIR takes DIR's shape)")
    src = drafter_dirs.load(d)
    # a DFlash DIR under another model.arch starts that family from it: its own parts start as
    # they start fresh (DFlash2's convolutions as the identity and its selector new, DSpark's Markov
    # head with a zero projection: model/dflash2.py, dspark.py), the rest is DIR's
    upgrade = cfg.model.arch != family.DEFAULT and src.cfg.arch == family.DEFAULT
    src_cfg = replace(src.cfg, **family.get(cfg.model.arch).drafter_fields(cfg.model)) if upgrade else src.cfg
    drafter = make_drafter(replace(src_cfg, copy_head=cfg.model.copy_head, target=cfg.model.target))
    # a copy head the source lacks starts fresh (its own init); one it has but the run
    # does not want is dropped
    state = {k: v for k, v in src.state_dict().items() if cfg.model.copy_head or not k.startswith("copy.")}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    allowed = ("copy.",) if cfg.model.copy_head and src.copy is None else ()
    if upgrade:  # the family's own weights, named as it names them
        own = family.get(cfg.model.arch)
        missing = [k for k in missing if not own.is_weight(k)]
    bad = list(unexpected) + [k for k in missing if not any(k.startswith(a) or f".{a}" in k for a in allowed)]
    if bad:
        raise drafter_dirs.DrafterDirError(f"--init-from {cfg.model.init_from!r}: weights that do not fit: "
                                           f"{', '.join(bad[:4])}")
    return drafter
