"""How much memory a `dflash train` process will reach, and how much it may take: the
training-memory check's two halves, torch-free.

What there is (`headroom`): the smaller of the host's MemAvailable and what the process's
memory cgroup leaves (limit minus its working set, for the cgroup itself and every ancestor
that has a limit; cgroup v2 `memory.max` / `memory.current`, v1 `memory.limit_in_bytes` /
`memory.usage_in_bytes`, "max" or v1's huge sentinel = no limit). A container's limit is
what the kernel's OOM killer enforces; MemAvailable is the host's and says nothing of it.
The working set leaves out the inactive file cache, which the kernel reclaims before it
kills (what kubelet and docker stats count too). The cgroup reader takes its root and the
`/proc/self/cgroup` text as arguments, so a test can point it at a fake tree.

What a run needs (`estimate`): the process's resident set now (interpreter, libraries, the
target where it shares the host) plus what comes after the check, phase by phase, the
largest phase being the peak. Counted from the config alone, calibrated against the
VmHWM of real runs (docs/failures.md, "The memory check"):
- the training step: float32 weights, gradients and AdamW's two moments (16 bytes a
  parameter), the step's activations (per drafter layer, the loss's logits, the target's
  forward where it shares the device, the hidden-state queue), and a fixed share for the
  allocator's arenas and what the end of a run imports;
- an intermediate save (`train.save_every` below `train.steps`): the snapshot the writer
  thread holds while training goes on (weights and moments, 12 bytes a parameter, and what
  the allocator keeps beside them: 16 measured); the
  final save copies nothing (checkpoint/checkpoint.py `snapshot(copy=False)`), and the
  best-checkpoint keeper holds weight copies (`train.estimate_every`);
- the export (bf16 copies, 2 bytes a parameter) and the served copy the eval decodes
  (`--eval`, 4 bytes a parameter), beside weights and moments;
- `--steps 0`: weights only (no gradients, no optimizer state), then the save and export.

`train.feature_cache` adds what it keeps once every training sequence has been seen
(`feature_cache_bytes`): it grows through the first epoch and is held to the end, so it is
checked once the data are prepared (their token count is known then), before the drafter.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20
# v1 reports "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on 4 KiB pages)
_NO_LIMIT = 1 << 62

# Calibration (docs/failures.md "The memory check", the table and the command that made it):
# activations per drafter layer are ACT_LAYER times the saved tensors counted in `_layer_bytes`;
# the loss holds its [rows x vocab] logits LOSS_COPIES times over (logits, log-softmax, their
# gradient); FIXED is what a CPU run adds beyond those (malloc arenas of the worker threads,
# the learning curve's matplotlib at the end).
ACT_LAYER = 1.1
LOSS_COPIES = 3.0
FIXED_CPU = 64 * MiB
FIXED_STEPS0 = 16 * MiB
SNAPSHOT_BYTES = 16  # a parameter's share of an intermediate save (see `estimate`)


# -- what there is ----------------------------------------------------------------------
@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory cgroup over this process: its path, limit and working set (bytes)."""
    version: int
    path: str
    limit: int
    used: int

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.used)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return None if v >= _NO_LIMIT else v


def _stat_field(path: Path, names: tuple[str, ...]) -> int:
    """The first of ``names`` in a memory.stat file (0 when absent)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return 0
    got = {}
    for line in lines:
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            got[k] = int(v)
    return next((got[n] for n in names if n in got), 0)


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """/proc/self/cgroup -> {"v2": path, "v1": path of the memory controller}."""
    out = {}
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and parts[0] == "0":
            out["v2"] = path
        elif "memory" in controllers.split(","):
            out["v1"] = path
    return out


def _chain(mount: Path, path: str) -> list[Path]:
    """The cgroup dir of ``path`` under ``mount`` and its ancestors up to the mount's root,
    those that exist (inside a container the path may name the host's view: then only the
    mount's root, which is the container's own cgroup)."""
    parts = [p for p in path.strip("/").split("/") if p and p not in (".", "..")]
    dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)] + [mount]
    return [d for d in dirs if d.is_dir()]


def cgroup_memory(root: str | os.PathLike = "/sys/fs/cgroup", proc_cgroup: str | None = None) -> CgroupMemory | None:
    """The memory cgroup (v2, or v1's memory controller) that leaves this process the least
    room, walking from its own cgroup up: None when no cgroup on the way has a limit (or the
    platform has no cgroups). ``root``: where cgroupfs is mounted (a v2 tree at the root, a
    v1 `memory/` controller below it, or a hybrid's `unified/`)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    root = Path(root)
    own = _own_paths(proc_cgroup)
    found: list[CgroupMemory] = []
    if "v2" in own:
        for mount in (root, root / "unified"):
            if not (mount / "cgroup.controllers").is_file():
                continue
            for d in _chain(mount, own["v2"]):
                limit = _read_int(d / "memory.max")
                used = _read_int(d / "memory.current")
                if limit is not None and used is not None:
                    used -= _stat_field(d / "memory.stat", ("inactive_file",))
                    found.append(CgroupMemory(2, "/" + str(d.relative_to(mount)).strip("."), limit, max(0, used)))
            break
    if "v1" in own and (root / "memory").is_dir():
        mount = root / "memory"
        for d in _chain(mount, own["v1"]):
            limit = _read_int(d / "memory.limit_in_bytes")
            used = _read_int(d / "memory.usage_in_bytes")
            if limit is not None and used is not None:
                used -= _stat_field(d / "memory.stat", ("total_inactive_file", "inactive_file"))
                found.append(CgroupMemory(1, "/" + str(d.relative_to(mount)).strip("."), limit, max(0, used)))
    return min(found, key=lambda c: c.headroom) if found else None


def host_available(meminfo: str | os.PathLike = "/proc/meminfo") -> int | None:
    """The host's MemAvailable in bytes (elsewhere free pages from sysconf), None if unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def headroom(root: str | os.PathLike = "/sys/fs/cgroup", proc_cgroup: str | None = None,
             meminfo: str | os.PathLike = "/proc/meminfo") -> tuple[int, str] | None:
    """(bytes this process may still take, what limits it, in words with its numbers): the
    smaller of the host's MemAvailable and its memory cgroup's room. None when neither is known."""
    host = host_available(meminfo)
    cg = cgroup_memory(root, proc_cgroup)
    host_said = f"the host has {gib(host)} available (MemAvailable)" if host is not None else ""
    if cg is not None and (host is None or cg.headroom < host):
        return cg.headroom, (f"the memory cgroup {cg.path} (v{cg.version}) leaves {gib(cg.headroom)} (limit "
                             f"{gib(cg.limit)}, {gib(cg.used)} in use)" + (f"; {host_said}" if host_said else ""))
    if host is None:
        return None
    return host, host_said + (f"; the memory cgroup {cg.path} leaves {gib(cg.headroom)}" if cg is not None else "")


def process_memory() -> tuple[int, int]:
    """(resident set now, its high-water mark so far) of this process, bytes (0, 0 if unknown)."""
    got = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    got[line.split(":")[0]] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if "VmHWM" not in got:  # no /proc: ru_maxrss, which also counts what the parent held before our exec
        try:
            import resource
            got.setdefault("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        except (ImportError, OSError):
            pass
    return got.get("VmRSS", got.get("VmHWM", 0)), got.get("VmHWM", got.get("VmRSS", 0))


# -- what a run needs ---------------------------------------------------------------------
@dataclass(frozen=True)
class RunShape:
    """What a run does, as far as its memory goes: from its config and the target's sizes."""
    steps: int
    batch_size: int
    num_anchors: int
    max_len: int
    save_every: int = 0
    estimate_every: int = 0
    eval_after: bool = False
    loss_chunk: int = 0              # rows per chunk of the head and loss; 0: the full logits
    loss_vocab: int = 0              # train.loss_vocab (0: the whole vocabulary)
    act_bytes: int = 4               # bytes of an activation (the compute dtype: 4 fp32, 2 bf16)
    host: bool = True                # the drafter trains on the host (CPU): the fixed share applies
    queue_size: int = 4
    target: dict = field(default_factory=dict)  # the target's sizes where its forward shares this memory
                                                # (hidden_size, intermediate_size, num_hidden_layers,
                                                # num_attention_heads); empty: it does not

    def __post_init__(self):
        # a sequence has at most max_len anchors (objective.sample_anchors takes min(num_anchors, S)):
        # num_anchors=5000 at max_len 256 trains what 256 does, and must be priced so
        object.__setattr__(self, "num_anchors", max(0, min(self.num_anchors, self.max_len)))


def _layer_bytes(f: dict, s: RunShape) -> int:
    """Tensors one drafter layer keeps for its backward in a training step: per query row
    (B x A x block rows) its projections, MLP and norms; per sequence the context's keys and
    values, and on the CPU the attention's scores and probabilities over context + block (CUDA's
    memory-efficient and flex kernels keep none: counting them there would refuse the recipe's
    8,192-row blocks on any GPU)."""
    h, nh, nkv, hd, inter = (f[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "intermediate_size"))
    per_seq = s.num_anchors * f["block_size"]
    rows = s.batch_size * per_seq
    row = nh * hd + 2 * nkv * hd + 3 * inter + 6 * h
    scores = 2 * s.batch_size * nh * per_seq * (s.max_len + per_seq) if s.host else 0
    ctx = s.batch_size * s.max_len * 2 * nkv * hd
    return (rows * row + scores + ctx) * s.act_bytes


def _loss_bytes(f: dict, s: RunShape) -> int:
    """The head and loss: the scored rows' logits, held LOSS_COPIES times (float32)."""
    rows = s.batch_size * s.num_anchors * (f["block_size"] - 1)
    if s.loss_chunk > 0:  # on the CPU about two chunks' worth, measured (malloc keeps one chunk's freed
        rows = min(rows, (2 if s.host else 1) * s.loss_chunk)  # logits while the next one's are made)
    cols = s.loss_vocab + s.batch_size * s.max_len if s.loss_vocab else f["vocab_size"]
    return int(LOSS_COPIES * rows * min(cols, f["vocab_size"]) * 4)


def _target_bytes(f: dict, s: RunShape) -> int:
    """The target's forward beside the drafter's step: every layer's hidden states (it keeps
    L + 1 of them), one layer's working tensors, and the hidden-state queue's items."""
    t = s.target
    if not t:
        return 0
    h, L = t["hidden_size"], t["num_hidden_layers"]
    tokens = s.batch_size * s.max_len
    fwd = tokens * h * (L + 1) + tokens * (3 * t["intermediate_size"] + 4 * h) \
        + (s.batch_size * t["num_attention_heads"] * s.max_len * s.max_len if s.host else 0)  # scores: CPU only
    queue = s.queue_size * tokens * len(f["target_layer_ids"]) * f["hidden_size"]
    return (fwd + queue) * s.act_bytes


def estimate(fields: dict, shape: RunShape) -> dict:
    """What the run adds to the process after the check, phase by phase (bytes), the largest
    ``"peak"`` and its phase's name ``"phase"``; every part named, for the refusal and the
    summary."""
    from .checkpoint_files import parameter_count

    n = parameter_count(fields)
    dv = int(fields.get("draft_vocab_size") or 0)
    frozen = dv * (4 * fields["hidden_size"] + 8)          # a draft vocabulary's head and ids
    weights, moments, grads = 4 * n + frozen, 8 * n, 4 * n
    export, served = 2 * n, (4 * n if shape.eval_after else 0)
    parts: dict[str, int] = {}
    if shape.steps <= 0:  # no gradients, no optimizer state: the drafter, then its save and export
        phases = {"the save and export": weights + max(export, served) + FIXED_STEPS0}
        parts = {"weights": weights, "export and eval copies": max(export, served), "fixed": FIXED_STEPS0}
    else:
        intermediate = 0 < shape.save_every < shape.steps
        act = ACT_LAYER * fields["num_hidden_layers"] * _layer_bytes(fields, shape)
        parts = {"weights, gradients and the optimizer's moments": weights + grads + moments,
                 "activations": int(act + _loss_bytes(fields, shape) + _target_bytes(fields, shape)),
                 # weights and moments copied (12 bytes a parameter), and ~4 more the allocator keeps
                 # beside them (measured: 15-16 bytes a parameter at 64 and 128 layers)
                 "a save's snapshot held by its writer": SNAPSHOT_BYTES * n if intermediate else 0,
                 "best-checkpoint weight copies": 2 * 4 * n if shape.estimate_every else 0,
                 "fixed": FIXED_CPU if shape.host else 0}
        fixed = parts["fixed"]
        phases = {"the training step": sum(parts.values()),
                  "the export": weights + moments + export + fixed,
                  "the eval": weights + moments + served + fixed}
    phase = max(phases, key=phases.get)
    return {"parameters": n, "peak": int(phases[phase]), "phase": phase,
            "parts": {k: int(v) for k, v in parts.items() if v}}


def feature_cache_bytes(tokens: int, *, width: int, elem_bytes: int, topk: int = 0) -> int:
    """`train.feature_cache` full: per kept token its ``width`` feature columns at the target's
    dtype (``elem_bytes``), and with a top-k (model/feature_cache.py) k float32 log-probs and
    int32 ids in place of the last hidden state's columns (left out of ``width`` then)."""
    return int(tokens) * (int(width) * int(elem_bytes) + 8 * int(topk))


def host_copies(fields: dict, shape: RunShape) -> dict:
    """A CUDA drafter's saves on the host: the final save copies weights and moments off the
    device all at once (checkpoint.write's `_to_host`), an intermediate one its snapshot."""
    from .checkpoint_files import parameter_count

    n = parameter_count(fields)
    copies = 12 * n if shape.steps > 0 else 4 * n
    return {"parameters": n, "peak": copies + FIXED_CPU, "phase": "the save's host copies",
            "parts": {"weights and the optimizer's moments copied to the host": copies}}


def refusal(est: dict, room: tuple[int, str] | None, *, now: int, knobs: str = "", device: str = "cpu",
            steps: int = 1) -> str | None:
    """One line when the peak of ``est`` (`estimate`'s) does not fit ``room`` (`headroom`'s,
    or a CUDA device's free memory), else None. ``now``: what this process holds already."""
    if room is None or est["peak"] <= room[0]:
        return None
    parts = ", ".join(f"{k} {gib(v)}" for k, v in est["parts"].items() if k != "fixed")
    held = f"on top of the {gib(now)} this process holds now" if now else f"on {device}"
    what = "its save and export" if steps <= 0 else "training it"
    return (f"the drafter has {est['parameters']:,} parameters: {what} needs about {gib(est['peak'])} more "
            f"at its peak ({est['phase']}: {parts}) {held}, and {room[1]}; make it smaller "
            f"(model.num_layers{knobs}), lower train.batch_size / train.num_anchors, or train where "
            f"there is more memory")


def run_summary(est: dict) -> dict:
    """summary.json's "memory": the check's estimate of the process's peak (what it held at
    the check plus the estimate, or its high-water mark by then if higher) beside the peak it
    reached (VmHWM, read now: at the end of the run), in bytes; the parts as the check saw them."""
    _, hwm = process_memory()
    peak = max(est.get("hwm_at_check", 0), est.get("held_at_check", 0) + est["peak"])
    return {"estimated_peak_bytes": peak, "measured_peak_bytes": hwm, "estimated_phase": est["phase"],
            "held_at_check_bytes": est.get("held_at_check", 0), "parameters": est["parameters"],
            "parts_bytes": est["parts"], "room_at_check_bytes": est.get("room_at_check"), "room": est.get("room")}
