"""The arithmetic behind docs/roles.md "Large targets": memory per GPU and feature bytes
per token for a dense 70B and a 235B MoE, from their published config.json values. Nothing
here is measured: it multiplies sizes.

    python bench/large_targets.py
"""
from __future__ import annotations

GiB = 2**30
# published config.json values (meta-llama/Llama-3.1-70B, Qwen/Qwen3-235B-A22B)
TARGETS = {
    "Llama-3.1-70B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, inter=28672, vocab=128256,
                          experts=0, moe_inter=0),
    "Qwen3-235B-A22B": dict(layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, inter=12288, vocab=151936,
                            experts=128, moe_inter=1536),
}
GPUS = {"80 GB (H100/A100)": 80 * 1e9, "141 GB (H200)": 141 * 1e9}
UTIL, OVERHEAD = 0.90, 3 * GiB   # vLLM's gpu_memory_utilization default; activations + runtime (assumed)
FUSED = 3                        # model.num_target_layers default (the paper's drafters fuse 5)


def params(c) -> tuple[float, float]:
    attn = c["hidden"] * c["heads"] * c["head_dim"] * 2 + c["hidden"] * c["kv_heads"] * c["head_dim"] * 2
    mlp = (c["experts"] * 3 * c["hidden"] * c["moe_inter"] + c["hidden"] * c["experts"]) if c["experts"] \
        else 3 * c["hidden"] * c["inter"]
    emb = 2 * c["vocab"] * c["hidden"]  # embedding + untied lm_head
    return c["layers"] * (attn + mlp) + emb, emb


def main() -> None:
    for name, c in TARGETS.items():
        total, emb = params(c)
        w = total * 2
        print(f"\n== {name}: {total / 1e9:.1f} B params -> bf16 weights {w / 1e9:.1f} GB")
        kv = 2 * c["layers"] * c["kv_heads"] * c["head_dim"] * 2
        hs = FUSED * c["hidden"] * 2
        print(f"KV cache per token: 2 x {c['layers']} layers x {c['kv_heads']} kv heads x {c['head_dim']} x 2 B "
              f"= {kv:,} B (whole model)")
        print(f"hidden-state buffer per token (extract_hidden_states, {FUSED} layers): {FUSED} x {c['hidden']} x 2 B "
              f"= {hs:,} B; features on disk the same + 5 B (int32 id, uint8 mask): "
              f"{(hs + 5) * 1e6 / 1e9:.1f} GB per million tokens ({5 * c['hidden'] * 2:,} B/token with 5 layers)")
        for tp in (4, 8):
            kv_gpu = kv * max(1, c["kv_heads"] // tp) // c["kv_heads"] if tp <= c["kv_heads"] else kv // c["kv_heads"]
            for g, cap in GPUS.items():
                budget = cap * UTIL - w / tp - OVERHEAD
                if budget <= 0:
                    print(f"TP={tp} on {g}: weights {w / tp / 1e9:.1f} GB per GPU > {cap * UTIL / 1e9:.0f} GB "
                          f"({UTIL:.0%} of {cap / 1e9:.0f} GB): does not fit")
                    continue
                print(f"TP={tp} on {g}: weights {w / 1e9:.1f}/{tp} = {w / tp / 1e9:.1f} GB; cache budget "
                      f"{cap / 1e9:.0f} x {UTIL} - {w / tp / 1e9:.1f} - {OVERHEAD / 1e9:.1f} = {budget / 1e9:.1f} GB; "
                      f"per token per GPU {kv_gpu:,} (KV) + {hs:,} (hidden states) B -> "
                      f"{budget / (kv_gpu + hs) / 1e3:.0f}k tokens in flight")
        layer = (c["hidden"] * c["heads"] * c["head_dim"] * 2 + c["hidden"] * c["kv_heads"] * c["head_dim"] * 2
                 + 3 * c["hidden"] * c["inter"])
        fc = FUSED * c["hidden"] * c["hidden"]
        for n in (1, 5):
            p = n * layer + fc
            print(f"drafter rank, {n} layer(s) at the target's dense sizes + fusion fc: {p / 1e9:.2f} B params x 16 B "
                  f"(fp32 weights, grads, AdamW m, v) = {p * 16 / 1e9:.1f} GB + frozen embedding and lm_head in bf16 "
                  f"{emb * 2 / 1e9:.1f} GB = {(p * 16 + emb * 2) / 1e9:.1f} GB before activations")


if __name__ == "__main__":
    main()
