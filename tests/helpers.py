"""Shared bits for the dflash tests: a small tiny-target config and a CLI runner."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the OTEL_* variables of this environment emptied: a run's telemetry goes to its own
# OTLP/JSON files only, never to a collector the developer's shell points at
NO_OTEL_ENV = {k: "" for k in os.environ if k.startswith("OTEL_")}

# Small enough for CPU tests; regeneration of these conversations is cached in DFLASH_CACHE.
TINY = ["--set", "data.num_conversations=48", "--set", "data.max_len=96",
        "--set", "data.regen_max_new_tokens=40", "--set", "data.regen_max_prompt_len=48",
        "--set", "train.batch_size=2", "--set", "train.num_anchors=4", "--set", "model.block_size=8",
        "--set", "eval.prompts=3", "--set", "eval.max_new_tokens=24"]


# one record of each kind the data loader drops, by the reason it counts
UNUSABLE_RECORDS = [
    {"messages": [{"role": "user", "content": "only a question"}]},                          # no_assistant_turn
    {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                  {"role": "assistant", "content": "c"}]},                                   # roles_out_of_order
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},  # empty
    {"text": "no turns at all"},                                                             # not_a_conversation
]


def run_dflash(*args, env=None, timeout=600, check=True):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"dflash {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def load_bench(name: str):
    """A bench/ script as a module (bench/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there (string annotations)
    spec.loader.exec_module(module)
    return module


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


_BEFORE_TORCH = """
import json, sys
from dflash.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules)
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "heavy": heavy}))
"""


def cli_before_torch(*args, env=None, drop=(), heavy: bool = False, timeout=180):
    """Run the command line in a fresh interpreter: ``({"rc", "torch"}, stderr lines)``, with
    ``heavy`` ``{"rc", "heavy"}`` (torch, transformers, safetensors: whichever got imported).
    Bad input must be one line and exit 2 before any of them loads."""
    e = {k: v for k, v in os.environ.items() if k not in drop}
    e.update(env or {})
    p = subprocess.run([sys.executable, "-c", _BEFORE_TORCH, *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env=e)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out = {"rc": out["rc"], "heavy": out["heavy"]} if heavy else {"rc": out["rc"], "torch": out["torch"]}
    return out, [ln for ln in p.stderr.splitlines() if ln.strip()]


def live(procs) -> list:
    """Those of ``procs`` (psutil.Process) still running: a zombie (exited, never reaped: this
    host's init reaps none) holds nothing and counts as gone."""
    import psutil

    out = []
    for q in procs:
        try:
            if q.status() != psutil.STATUS_ZOMBIE:
                out.append(q)
        except psutil.NoSuchProcess:
            pass
    return out


def free_port() -> int:
    """A loopback port nobody holds right now (torchrun's rendezvous, a stand-in receiver)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_one_pass_equals_per_block(d, embed, head, block_logits, *, hidden: int, vocab: int, block: int,
                                    atol: float):
    """A drafter's one-pass training forward (`train_forward`: every anchored block at once,
    the block mask keeping them apart) against ``block_logits(feats, ids, p)``, the logits of
    the block anchored at p built the way inference builds it: equal at five anchors on 40
    random tokens (three target layers' features, float64), slot k labelled with token p+k."""
    import torch

    S = 40
    torch.manual_seed(1)
    feats = torch.randn(1, S, 3 * hidden, dtype=torch.float64)
    ids = torch.randint(0, vocab - 1, (1, S))
    anchors = torch.tensor([[3, 9, 17, 30, S - block]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    from dflash.model.objective import slot_labels
    logits = d.train_forward(feats, ids, anchors, valid, embed, head, slot_labels(ids, anchors, block))
    labels = slot_labels(ids, anchors, block)
    for j, p in enumerate(anchors[0].tolist()):
        ref = block_logits(feats, ids, p)
        assert torch.allclose(logits[0, j], ref[0], atol=atol), f"block at anchor {p} differs"
        assert labels[0, j].tolist() == ids[0, p + 1:p + block].tolist()  # slot k predicts p+k


SMALL_DRAFTER = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                     vocab_size=100, target_layer_ids=[0, 1], mask_token_id=5, block_size=4)


def small_drafter(seed: int | None = 0, **over):
    """A random DFlashDrafter with no target behind it, for tests of what holds or wraps a
    drafter (checkpoints, heads, vocabularies): `SMALL_DRAFTER`'s sizes, any DrafterConfig
    field replaced by ``over``; torch seeded with ``seed`` first unless it is None."""
    import torch

    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    if seed is not None:
        torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig(**(SMALL_DRAFTER | over)))


def drafter_config(model, tok, block_size: int):
    """A drafter's config for a tiny target ``(model, tok)``: target layers 1 and 2 fused, the
    target's vocabulary, MASK id 16 (the tiny targets' mask token)."""
    from dflash.model.drafter import DrafterConfig
    return DrafterConfig.from_target(model.config, target_layer_ids=[1, 2], vocab_size=len(tok),
                                     mask_token_id=16, block_size=block_size)


@functools.cache
def _scripted_drafter_class():
    from dflash.model.drafter import DFlashDrafter

    class ScriptedDrafter(DFlashDrafter):
        def __init__(self, cfg, reference, prompt_len, good):
            super().__init__(cfg)
            self.reference, self.prompt_len, self.good = reference, prompt_len, good

        def draft(self, anchor_id, anchor_pos, ctx_kv, embed, lm_head):
            import torch
            gen = anchor_pos - self.prompt_len  # the anchor is generated token number `gen`
            out = []
            for k in range(1, self.cfg.block_size):
                t = self.reference[gen + k] if gen + k < len(self.reference) else 0
                out.append(t if k <= self.good else (t + 1) % 1000)
            return torch.tensor([out])

    return ScriptedDrafter


def scripted_drafter(model, tok, reference: list[int], prompt_len: int, good: int, block_size: int):
    """A drafter for the tiny target ``(model, tok)`` that drafts ``reference`` (the target's
    greedy output for a prompt of ``prompt_len`` tokens), right for the first ``good`` slots of
    every block and wrong after them: every verify step accepts exactly ``good`` drafts (a
    hybrid target's partial accept: a restore and a replay)."""
    return _scripted_drafter_class()(drafter_config(model, tok, block_size), reference, prompt_len, good)


def served_drafter(path):
    """A random 1-layer served-format drafter for tiny-qwen3 (block 4), written in a second:
    a drafter dir for eval tests that need no training."""
    import torch

    from dflash.checkpoint.export import write_export
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                    block_size=4, num_hidden_layers=1)
    torch.manual_seed(1)
    return write_export(DFlashDrafter(cfg), tc, Path(path), dtype="float32", target="tiny-qwen3")


# ------------------------------------------------------------------ prompt lookup, independently
# the rule written the slow obvious way, apart from dflash's own (dflash/model/prompt_lookup.py)


def brute_lookup(ids: list[int], length: int, max_n: int = 3) -> list[int]:
    """The rule as stated (longest n first, then the latest earlier occurrence; known tokens
    only), written the slow obvious way, apart from dflash's own."""
    p = len(ids) - 1
    for n in range(min(max_n, p), 0, -1):
        key = ids[p - n + 1:]
        for j in range(p - 1, n - 2, -1):
            if ids[j - n + 1:j + 1] == key:
                return ids[j + 1:min(j + 1 + length, p + 1)]
    return []


def lookup_steps_from_output(prompt: list[int], out: list[int], max_new: int, block: int,
                             eos: set[int] = frozenset()) -> list[int]:
    """accepted + 1 per verify step that prompt lookup would take, from the target's greedy
    output ids alone (`out`: decoded past max_new and past any eos, as far as a block reaches):
    a proposal is accepted up to its first token that differs from the output."""
    steps, c = [], 1  # out[0] comes from the prompt's own forward
    while c < max_new and out[c - 1] not in eos:
        proposal = brute_lookup(prompt + out[:c], block - 1)
        m = 0
        while m < len(proposal) and proposal[m] == out[c + m]:
            m += 1
        steps.append(m + 1)
        kept = out[c:c + m + 1]
        c += m + 1
        if any(t in eos for t in kept):
            break
    return steps


def steps_started(run) -> bool:
    """A run's stage spans are on disk: its steps have begun (the set-up's own phases are written
    before that, dflash/phases.py, so a telemetry file alone no longer says training started)."""
    from otel import read_spans

    for f in sorted((Path(run) / "telemetry").rglob("traces.jsonl")):
        if any((s.get("attributes") or {}).get("worker") for s in read_spans(str(f))):
            return True
    return False
