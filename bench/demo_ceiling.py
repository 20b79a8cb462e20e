"""What the demo's data allows: two reference figures for the drafter's held-out acceptance.

The demo trains on the replies SmolLM2 regenerated itself (configs/demo.yaml: 288). Two
cheap measurements on those same replies say where a drafter's tau can come from
(docs/demo-recipe.md discusses them):

- prompt lookup: at every reply position p, draft the tokens that followed the latest
  earlier occurrence of the last 3, 2 or 1 tokens (longest match first) and count how many
  a greedy verify would accept. Its mean (accepted + 1) is the tau that copying from the
  context alone would give, per block size;
- (--probe) a direct probe: an MLP on the target's features at p-1 (the demo's fused
  layers) and the embedding of token p, predicting token p+1 through the frozen lm_head,
  trained on the training replies' positions and scored on the held-out ones. No
  attention to learn: it says how far the target's features alone generalise from this
  little data.

Both use the demo's split: the last `--held-out` samples are scored. The replies come from
the regeneration cache (a `make demo` fills it; otherwise this regenerates them first).

    .venv/bin/python bench/demo_ceiling.py [--probe] [--held-out 16]
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lookup_draft(ids: list[int], p: int, length: int, max_n: int = 3) -> list[int]:
    """Tokens after the latest earlier occurrence of ids[p-n+1 : p+1], longest n first.
    Only tokens up to p are known when drafting at p: the copy stops there (a match at q
    yields at most p - q tokens), as a real prompt-lookup decoder's would. The rule is
    dflash/model/prompt_lookup.py's, the one `dflash eval`'s baseline decodes with."""
    from dflash.model.prompt_lookup import propose

    return propose(ids[:p + 1], length, max_n)


def lookup_tau(samples, block: int) -> float:
    """Mean (accepted + 1) over reply positions whose next token is a reply token."""
    steps = []
    for s in samples:
        ids, lm = s.input_ids, s.loss_mask
        for p in range(1, len(ids) - 1):
            if not (lm[p] and lm[p + 1]):
                continue
            accepted = 0
            for k, t in enumerate(lookup_draft(ids, p, block - 1)):
                j = p + 1 + k
                if j < len(ids) and lm[j] and ids[j] == t:
                    accepted += 1
                else:
                    break
            steps.append(accepted + 1)
    return sum(steps) / max(1, len(steps))


def probe_accuracy(model, samples, held_out: int, layer_ids, steps: int = 300, seed: int = 0) -> list:
    """Held-out next-token accuracy of the direct probe every 50 steps: [[step, acc], ...]."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from dflash.model import target as T

    torch.manual_seed(seed)
    emb = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    norm = model.get_decoder().norm

    def rows(ss):
        xs, ys = [], []
        for s in ss:
            ids = torch.tensor([s.input_ids])
            with torch.no_grad():
                f = T.capture_hidden(model, ids, torch.ones_like(ids), layer_ids)[0]
            for p in range(1, len(s.input_ids) - 1):
                if s.loss_mask[p] and s.loss_mask[p + 1]:
                    xs.append(torch.cat([f[p - 1], emb[s.input_ids[p]]]))
                    ys.append(s.input_ids[p + 1])
        return torch.stack(xs), torch.tensor(ys)

    x_tr, y_tr = rows(samples[:-held_out])
    x_ho, y_ho = rows(samples[-held_out:])
    width = x_tr.shape[1]
    hidden = emb.shape[1]
    probe = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * hidden), nn.SiLU(), nn.Linear(4 * hidden, hidden))
    opt = torch.optim.AdamW(probe.parameters(), lr=1e-3)
    curve = []
    for step in range(steps + 1):
        if step % 50 == 0:
            with torch.no_grad():
                acc = ((norm(probe(x_ho)) @ head.t()).argmax(-1) == y_ho).float().mean().item()
            curve.append([step, round(acc, 4)])
            print(f"probe step {step}: held-out accuracy {acc:.3f}", file=sys.stderr)
        if step == steps:
            break
        i = torch.randint(0, len(x_tr), (256,))
        loss = F.cross_entropy(norm(probe(x_tr[i])) @ head.t(), y_tr[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return curve


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--held-out", type=int, default=16, help="samples scored (the last ones of the demo's training samples)")
    ap.add_argument("--probe", action="store_true", help="also train the direct probe (~3 min on 2 cores)")
    a = ap.parse_args()

    import torch

    from dflash.config import load_config
    from dflash.prep.prepare import prepare
    from dflash.model import target as T

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    cfg = load_config(a.config)
    model, tok = T.load_target(cfg.model.target)
    samples = prepare(cfg, model, tok).samples  # the demo's own training samples (regenerated, cached)
    out = {"samples": len(samples), "held_out": a.held_out, "lookup_tau": {}}
    for block in (2, 4, 8, 16):
        ho, everything = lookup_tau(samples[-a.held_out:], block), lookup_tau(samples, block)
        out["lookup_tau"][block] = {"held_out": round(ho, 3), "all": round(everything, 3)}
        print(f"prompt lookup, block {block:2d}: tau {ho:.3f} on the held-out replies, {everything:.3f} on all",
              file=sys.stderr)
    if a.probe:
        layer_ids = cfg.model.target_layer_ids or T.default_layer_ids(T.num_layers(model), cfg.model.num_target_layers)
        out["probe_layers"] = list(layer_ids)
        out["probe_accuracy"] = probe_accuracy(model, samples, a.held_out, layer_ids)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
