"""What a target token costs on this CPU, and which levers make it cheaper (issue 47, item 2).

The two ways a drafter's data meets the target, each timed through the product's own code:
  regen   the target writes replies (`prep/regenerate._generate_left_padded`, what
          `data.regenerate=on` runs): batched greedy decoding of left-padded prompts, the
          fused layers' features kept as regeneration keeps them
  read    the target reads text windows (`model/features.target_features` with the final
          layer, then `offline/capture.top_logprobs`: what `dflash capture` runs for
          `train.loss=kl`), in batches sorted by length as capture sorts them

Arms (NAME=KIND:key=value,...), each a child process with its own thread count, alternated
round by round in one run so the machine's swings fall on every arm alike:
  regen:batch=B,threads=T[,procs=P][,workers=W]   P processes at once, each T threads, each 1/P
          of the prompts; W Python threads in a process, each generating whole batches
  read:batch=B,threads=T[,order=sorted|pool]
A child loads the target, then waits for the parent's "go" (P processes start together), so a
figure is the work alone, not the load. Beside the arms, a fp32 GEMM (the shape of a 64-row
and a 640-row linear layer) gives this machine's peak, so each arm says how near it runs:
model GFLOP/s counts 2 x parameters per token processed (padding and finished rows included,
the work the CPU did), useful tokens/s only the tokens kept.

Outputs: replies equal to the first regen arm's (greedy: only near-ties may tip with batch
shape or threads), read top-k ids equal to the first read arm's and their log-probs' largest
difference.

    .venv/bin/python bench/target_tokens.py                 # the default arms, 2 rounds (~10 min)
    .venv/bin/python bench/target_tokens.py --arms 'b64=regen:batch=64,threads=2' --rounds 1

Time it alone: every arm takes both cores. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_ARMS = ",".join([
    "regen_b16_t2=regen:batch=16,threads=2",
    "regen_b64_t2=regen:batch=64,threads=2",     # the demo's regen_batch_size
    "regen_b128_t2=regen:batch=128,threads=2",
    "regen_b64_t1=regen:batch=64,threads=1",
    "regen_b64_2x1=regen:batch=64,threads=1,procs=2",
    "read_b4_t2=read:batch=4,threads=2",         # capture's batch: train.batch_size (4 in the demo)
    "read_b16_t2=read:batch=16,threads=2",
    "read_b4_pool=read:batch=4,threads=2,order=pool",
    "read_b4_2x1=read:batch=4,threads=1,procs=2",
])


def parse_arms(text: str) -> dict[str, dict]:
    arms = {}
    for part in _split_arms(text):
        name, _, spec = part.partition("=")
        kind, _, opts = spec.partition(":")
        if kind not in ("regen", "read") or not name:
            sys.exit(f"bench/target_tokens.py: arm {part!r}: expected NAME=regen|read:key=value,...")
        arm = {"kind": kind, "batch": 16, "threads": 2, "procs": 1, "workers": 1, "order": "sorted"}
        for kv in filter(None, opts.split(",")):
            k, _, v = kv.partition("=")
            if k not in arm or k == "kind":
                sys.exit(f"bench/target_tokens.py: arm {name!r}: unknown key {k!r} (batch, threads, procs, workers, order)")
            arm[k] = v if k == "order" else int(v)
        arms[name] = arm
    return arms


def _split_arms(text: str) -> list[str]:
    """'a=regen:batch=16,threads=2,b=read:...' -> one string per arm (a new arm starts at NAME=KIND:)."""
    out, cur = [], []
    for tok in text.split(","):
        if "=regen:" in tok or "=read:" in tok:
            if cur:
                out.append(",".join(cur))
            cur = [tok]
        else:
            cur.append(tok)
    if cur:
        out.append(",".join(cur))
    return out


# --------------------------------------------------------------------------- the child


def child(args) -> None:
    """Load, say ready, wait for go, do this arm's share of the work, print one JSON line."""
    import torch

    from dflash.config import load_config
    from dflash.data import chat_template
    from dflash.data.conversations import load_conversations
    from dflash.data.dataset import build_samples, collate, truncated_prompt
    from dflash.model import target as target_mod
    from dflash.model.features import target_features
    from dflash.offline.capture import top_logprobs
    from dflash.prep.regenerate import _eos_ids, _generate_left_padded

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    model, tok = target_mod.load_target(cfg.model.target, dtype=torch.float32, seed=cfg.model.target_seed)
    chat_template.configure_from(tok, cfg.data)
    L = target_mod.num_layers(model)
    layer_ids = cfg.model.target_layer_ids or target_mod.default_layer_ids(L, cfg.model.num_target_layers)
    convs = load_conversations(args.data, limit=args.convs, seed=0)
    res: dict = {"kind": args.kind}
    if args.kind == "regen":
        prompts = [truncated_prompt(tok, c, cfg.data.regen_max_prompt_len)[1] for c in convs][:args.n]
        prompts.sort(key=len)  # as regeneration sorts them
        mine = prompts[args.shard::args.procs]
        eos, pad = _eos_ids(model, tok), tok.pad_token_id
        _ready()
        t0 = time.perf_counter()
        replies, rows, kept, padded = [], 0, 0, 0
        batches = [mine[b:b + args.batch] for b in range(0, len(mine), args.batch)]

        def one(batch):
            torch.set_num_threads(args.threads)  # this thread's own OpenMP team
            return _generate_left_padded(model, batch, pad, eos, cfg.data.regen_max_new_tokens, "cpu", layer_ids)[0]
        if args.workers > 1:  # W Python threads, each generating whole batches (the GIL is free in torch's ops)
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(args.workers) as pool:
                made = list(pool.map(one, batches))
        else:
            made = [one(b) for b in batches]
        for batch, gens in zip(batches, made):
            steps = max(map(len, gens))
            width = max(map(len, batch))
            rows += len(batch) * (width + steps)                       # what the CPU ran
            kept += sum(len(p) + len(g) for p, g in zip(batch, gens))  # what a sample keeps
            padded += len(batch) * width - sum(map(len, batch))
            replies += [hashlib.sha1(json.dumps([p, g]).encode()).hexdigest()[:16] for p, g in zip(batch, gens)]
        res.update(seconds=time.perf_counter() - t0, units=len(mine), tokens_run=rows, tokens_kept=kept,
                   prompt_padding=padded, replies=replies)
    else:
        samples = build_samples(tok, convs, max_len=cfg.data.max_len, min_loss_tokens=2 * cfg.model.block_size,
                                long="split")[:args.n]
        order = sorted(range(len(samples)), key=lambda i: len(samples[i])) if args.order == "sorted" \
            else list(range(len(samples)))
        mine = order[args.shard::args.procs]
        H = model.config.get_text_config().hidden_size
        _ready()
        t0 = time.perf_counter()
        rows, kept, tops = 0, 0, {}
        for b in range(0, len(mine), args.batch):
            idx = mine[b:b + args.batch]
            batch = collate([samples[i] for i in idx], tok.pad_token_id, b)
            feats = target_features(model, batch, list(layer_ids) + [target_mod.FINAL], "cpu")
            lp, ids = top_logprobs(model, feats[..., -H:], cfg.train.kl_topk or 64)
            rows += batch.input_ids.numel()
            kept += sum(batch.lengths)
            for k, i in enumerate(idx):
                n = batch.lengths[k]
                tops[i] = (ids[k, :n].tolist(), lp[k, :n])
        res.update(seconds=time.perf_counter() - t0, units=len(mine), tokens_run=rows, tokens_kept=kept)
        if args.tops:  # the top-k, for the parent's comparison across arms
            torch.save(tops, args.tops)
    print("RESULT " + json.dumps(res), flush=True)


def _ready() -> None:
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(1)


# --------------------------------------------------------------------------- the parent


def gemm_peak(threads: int) -> dict:
    """fp32 GFLOP/s of a linear layer's GEMM at 64 and 640 rows (SmolLM2's 576 -> 1536), alone."""
    code = ("import torch,time,json\n"
            f"torch.set_num_threads({threads})\n"
            "out={}\n"
            "for m in (64,640):\n"
            "  a=torch.randn(m,576);b=torch.randn(576,1536)\n"
            "  for _ in range(5): a@b\n"
            "  t=time.perf_counter();r=0\n"
            "  while time.perf_counter()-t<1.5: a@b;r+=1\n"
            "  out[m]=2*m*576*1536*r/(time.perf_counter()-t)/1e9\n"
            "print(json.dumps(out))\n")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout)


def run_arm(name: str, arm: dict, args, rnd: int) -> dict:
    """The arm's processes loaded, started together; its wall from go to the last result."""
    env = dict(os.environ, OMP_NUM_THREADS=str(arm["threads"]), MKL_NUM_THREADS=str(arm["threads"]))
    procs = []
    for shard in range(arm["procs"]):
        tops = Path(args.work) / f"tops-{name}-{shard}.pt" if arm["kind"] == "read" and rnd == 0 else None
        cmd = [sys.executable, __file__, "--child", arm["kind"], "--batch", str(arm["batch"]),
               "--threads", str(arm["threads"]), "--procs", str(arm["procs"]), "--shard", str(shard),
               "--workers", str(arm["workers"]), "--order", arm["order"], "--config", args.config, "--data", args.data, "--convs", str(args.convs),
               "--n", str(args.prompts if arm["kind"] == "regen" else args.windows)]
        if tops:
            cmd += ["--tops", str(tops)]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      stderr=subprocess.DEVNULL))
    for p in procs:
        while (line := p.stdout.readline()) and line.strip() != "READY":
            pass
        if not line:
            sys.exit(f"bench/target_tokens.py: arm {name}: a child exited before it was ready (rc {p.wait()})")
    t0 = time.perf_counter()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    parts = []
    for p in procs:
        out = p.communicate()[0]
        got = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not got:
            sys.exit(f"bench/target_tokens.py: arm {name}: a child failed (rc {p.returncode})")
        parts.append(json.loads(got[-1][7:]))
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "units": sum(x["units"] for x in parts), "tokens_run": sum(x["tokens_run"] for x in parts),
           "tokens_kept": sum(x["tokens_kept"] for x in parts)}
    if arm["kind"] == "regen":
        res["replies"] = [r for x in parts for r in x["replies"]]
        res["prompt_padding"] = sum(x["prompt_padding"] for x in parts)
    return res


def compare_tops(work: Path, names: list[str], arms: dict) -> dict:
    import torch
    ref, out = None, {}
    for name in names:
        tops = {}
        for shard in range(arms[name]["procs"]):
            tops.update(torch.load(work / f"tops-{name}-{shard}.pt"))
        if ref is None:
            ref, out[name] = tops, {"ids_equal": 1.0, "max_logprob_diff": 0.0}
            continue
        same = total = 0
        diff = 0.0
        for i, (ids, lp) in tops.items():
            rids, rlp = ref[i]
            same += sum(a == b for a, b in zip(ids, rids))
            total += len(ids)
            diff = max(diff, float((lp - rlp).abs().max()))
        out[name] = {"ids_equal": same / max(total, 1), "max_logprob_diff": diff}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="NAME=regen|read:key=value,... (see the docstring)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--data", default=str(ROOT / "runs" / "data-scale" / "pool.jsonl"),
                    help="conversations (the data curve's pool; `bench/data_scale.py prep` writes it)")
    ap.add_argument("--convs", type=int, default=600, help="conversations read (prompts and windows come from them)")
    ap.add_argument("--prompts", type=int, default=128, help="regen: prompts per arm")
    ap.add_argument("--windows", type=int, default=128, help="read: text windows per arm")
    ap.add_argument("--work", default=str(ROOT / "runs" / "target-tokens"))
    # the child's own flags
    ap.add_argument("--child", choices=("regen", "read"), help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--procs", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--order", default="sorted", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tops", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.kind = args.child
        return child(args)
    if not Path(args.data).is_file():
        sys.exit(f"bench/target_tokens.py: --data {args.data!r} is not a file (run `bench/data_scale.py prep`, "
                 "or give a conversations file)")
    arms = parse_arms(args.arms)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    peak = {f"threads_{t}": gemm_peak(t) for t in (1, 2)}
    print(f"fp32 GEMM peak here (GFLOP/s, 64 / 640 rows): {peak}", file=sys.stderr)
    from dflash.config import load_config
    from dflash.model import target as target_mod
    import torch
    model, _ = target_mod.load_target(load_config(args.config).model.target, dtype=torch.float32)
    emb = model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters()) - (0 if model.get_output_embeddings().weight is emb else emb.numel())
    del model  # parameters per token: every layer plus the head (a tied embedding counted once, as the head)
    walls: dict[str, list[dict]] = {n: [] for n in arms}
    for rnd in range(args.rounds):
        names = list(arms) if rnd % 2 == 0 else list(reversed(arms))  # order flipped each round
        for name in names:
            r = run_arm(name, arms[name], args, rnd)
            walls[name].append(r)
            print(f"[round {rnd}] {name}: {r['wall_s']:.1f} s, {r['units']} units", file=sys.stderr, flush=True)
    ref_regen = next((n for n in arms if arms[n]["kind"] == "regen"), None)
    table = {}
    for name, runs in walls.items():
        arm = arms[name]
        wall = statistics.median(r["wall_s"] for r in runs)
        r0 = runs[0]
        row = {**arm, "wall_s": [round(r["wall_s"], 2) for r in runs], "s_per_unit": wall / r0["units"],
               "useful_tokens_per_s": r0["tokens_kept"] / wall,
               "model_gflops": 2 * params * r0["tokens_run"] / wall / 1e9,
               "waste": 1 - r0["tokens_kept"] / r0["tokens_run"]}
        if arm["kind"] == "regen":
            ref = walls[ref_regen][0]["replies"]
            row["replies_equal"] = sum(a == b for a, b in zip(sorted(r0["replies"]), sorted(ref))) / len(ref) \
                if len(ref) == len(r0["replies"]) else None
            row["prompt_padding"] = r0["prompt_padding"] / r0["tokens_run"]
        table[name] = row
    reads = [n for n in arms if arms[n]["kind"] == "read"]
    if reads:
        for name, cmp in compare_tops(Path(args.work), reads, arms).items():
            table[name].update(cmp)
    for kind in ("regen", "read"):
        names = [n for n in arms if arms[n]["kind"] == kind]
        if not names:
            continue
        base = table[names[0]]["s_per_unit"]
        print(f"\n{kind}: per {'reply' if kind == 'regen' else 'window'}, against {names[0]} (median of "
              f"{args.rounds} round(s))", file=sys.stderr)
        for n in names:
            t = table[n]
            extra = (f"replies equal {t['replies_equal']:.3f}" if kind == "regen"
                     else f"top-k ids equal {t['ids_equal']:.4f}, max |dlogprob| {t['max_logprob_diff']:.2e}")
            print(f"  {n:16s} {t['s_per_unit']:.3f} s  speed x{base / t['s_per_unit']:.2f}  "
                  f"{t['useful_tokens_per_s']:.0f} useful tok/s  {t['model_gflops']:.0f} GFLOP/s  "
                  f"waste {t['waste']:.3f}  {extra}", file=sys.stderr)
    print(json.dumps({"peak_gflops": peak, "params": params, "arms": table}))


if __name__ == "__main__":
    main()
