"""configs/paper-b16.yaml: the DFlash paper's recipe loads, holds the published values, and
cites a source for every value it sets."""
from __future__ import annotations

import re

from helpers import ROOT
from dflash.config import load_config
from dflash.preflight.layer_ids import default_layer_ids

PAPER = ROOT / "configs" / "paper-b16.yaml"


def test_it_loads_and_holds_the_papers_values():
    cfg = load_config(str(PAPER))
    m, d, t = cfg.model, cfg.data, cfg.train
    assert m.target == "Qwen/Qwen3-8B"
    assert (m.num_layers, m.block_size, m.num_target_layers) == (5, 16, 5)
    # target layers from layer 1 to N-3, N = 36 for Qwen3-8B
    assert default_layer_ids(36, m.num_target_layers) == [1, 9, 17, 25, 33]
    assert d.num_conversations == 800_000 and d.regenerate == "on" and d.max_len == 3072
    assert (t.lr, t.warmup_ratio, t.grad_clip) == (6e-4, 0.04, 1.0)
    assert t.num_anchors == 512 and t.loss_gamma == 7.0
    assert (t.loss, t.loss_weights) == ("ce", "decay")
    # 6 epochs of ~800K samples at the stated global batch (8 ranks x batch_size)
    assert t.steps * 8 * t.batch_size == 6 * d.num_conversations
    assert not m.copy_head and m.drafter_init == "random"


def test_every_value_has_its_source():
    for n, line in enumerate(PAPER.read_text().splitlines(), 1):
        if re.match(r"^\s+\w+:\s*\S", line):  # a key with a value (sections have none)
            assert re.search(r"#\s*(\[[PSZD]\])+", line), f"line {n} cites no source: {line.strip()}"
