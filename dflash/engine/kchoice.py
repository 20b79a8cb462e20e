"""k from the measurements: how many tokens a drafter should propose per verify step on this
machine, from its per-position acceptance and the engine's measured step costs.

Drafting more tokens buys acceptance at the later positions, which is small for a weak drafter
(the demo's third position is accepted in under 1% of the steps), and costs a longer verify
and a longer draft at every step. The fastest k maximises

    tokens per step / seconds per step = (1 + a_1 + ... + a_k) / (rest + verify(k) + draft(k))

where a_j is the share of verify steps that accepted position j (greedy acceptance keeps a
prefix, so these shares do not depend on k), and the costs come from the engine's own
timing (engine/vllm_worker.py's profiler window): a target step of 1 token (no speculation)
and of K + 1 tokens (the drafter served at K = block_size - 1) give the target's cost per
token; the drafter's forward over its k + 1 query tokens is taken to grow as the target's
does; the rest (scheduling, bookkeeping, the engine's processes talking) does not depend
on k. The paired verdict serves the pick beside K, so the model is checked where it is used.

The pick is recorded in the export (`serving_k.json`, which a new export removes: it was
measured on the weights beside it) and read by `dflash serve --k auto`.
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from ..errors import ConfigError
from ..preflight.checkpoint_files import SERVING_K


def per_position(steps: list[dict], k_max: int) -> list[float]:
    """The share of verify steps that accepted draft position j = 1..k_max, from our eval's
    per-prompt records (`acceptance_lengths`: accepted + 1 per verify step)."""
    lengths = [a for s in steps for a in s["acceptance_lengths"]]
    if not lengths:
        return [0.0] * k_max
    return [round(sum(a - 1 >= j for a in lengths) / len(lengths), 4) for j in range(1, k_max + 1)]


def step_s(k: int, K: int, costs: dict) -> float:
    """Predicted seconds per verify step at k drafted tokens (the module doc's model), from
    costs measured at K: ``none_verify_s`` (a 1-token target step), ``verify_s``, ``draft_s``
    and ``rest_s`` (per step of the drafter served at K)."""
    v1, vK = costs["none_verify_s"], costs["verify_s"]
    per_token = max(0.0, (vK - v1) / K) if K else 0.0
    fixed = v1 - per_token

    def verify(n_drafts: int) -> float:
        return fixed + per_token * (n_drafts + 1)

    return costs["rest_s"] + verify(k) + costs["draft_s"] * verify(k) / verify(K)


def pick(acceptance: list[float], costs: dict, K: int) -> dict:
    """The fastest k in 1..K: ``{"k", "predicted_tokens_per_s": {k: ...}, "tokens_per_step": {k: ...}}``
    (ties go to the smaller k: fewer drafts for the same speed)."""
    if K < 1:
        raise ValueError("pick: K >= 1")
    speeds, per_step = {}, {}
    for k in range(1, K + 1):
        tps = 1 + sum(acceptance[:k])
        per_step[k] = round(tps, 4)
        speeds[k] = round(tps / step_s(k, K, costs), 3)
    best = max(speeds, key=lambda k: (speeds[k], -k))
    return {"k": best, "predicted_tokens_per_s": speeds, "tokens_per_step": per_step}


def record(export: Path, info: dict) -> Path | None:
    """Write the pick beside the export's weights (`serving_k.json`), dated."""
    path = Path(export) / SERVING_K
    body = {"date": datetime.date.today().isoformat()} | info
    tmp = path.with_suffix(".tmp")
    try:  # after the engines ran: a place that cannot take the file (a dir by that name, a full disk) is said
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        tmp.replace(path)
    except OSError as e:
        print(f"dflash engine: k auto: not recorded in {export}: {path.name}: {e.strerror or e}", file=sys.stderr)
        if tmp.is_file():
            tmp.unlink()
        return None
    return path


def read(export: Path) -> dict | None:
    path = Path(export) / SERVING_K
    if not path.is_file():
        if path.exists() or path.is_symlink():  # a dir, a FIFO, a dangling link: not "never measured"
            raise ConfigError(f"{path}: not a regular file (a measured k is a JSON file there); remove it")
        return None
    from ..preflight.inputs import read_json_object
    return read_json_object(path, str(path), ConfigError)


def serve_k(export: str, block_size: int) -> tuple[int, dict]:
    """`dflash serve --k auto`: the k recorded in the export, checked against its block size;
    no record (never measured, or a new export since): one line saying how to measure it."""
    rec = read(Path(export))
    if rec is None:
        raise ConfigError(f"--k auto: {export} holds no measured k ({SERVING_K}); measure it with "
                          f"`dflash eval --checkpoint {export} --target TARGET --engine vllm` (the verdict picks k "
                          f"and records it there), or give --k N (1..{block_size - 1})")
    k = rec.get("k")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= block_size - 1:
        raise ConfigError(f"--k auto: {export}/{SERVING_K} records k={k!r}; expected an integer in "
                          f"1..{block_size - 1} (block_size - 1): measure it again, or give --k N")
    return k, rec
