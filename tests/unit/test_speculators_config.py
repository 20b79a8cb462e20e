"""configs/speculators-2026.yaml: speculators' 2026 DFlash recipe loads, holds its values (Muon,
D-PACE, sliding windows, ~262k tokens a step) and cites a source for every value it sets."""
from __future__ import annotations

import re

from helpers import ROOT
from dflash.config import load_config

RECIPE = ROOT / "configs" / "speculators-2026.yaml"


def test_it_loads_and_holds_speculators_values():
    cfg = load_config(str(RECIPE))
    m, d, t = cfg.model, cfg.data, cfg.train
    assert (m.arch, m.num_layers, m.block_size, m.draft_vocab) == ("dflash", 5, 16, 0)
    assert m.layer_types == ["sliding_attention"] * 5 and m.sliding_window == 2048
    assert (t.optimizer, t.muon_lr, t.muon_momentum, t.muon_weight_decay, t.muon_adjust_lr) == \
        ("muon", 1e-3, 0.95, 0.1, "match_rms_adamw")
    assert (t.loss, t.loss_weights, t.lr) == ("ce", "dpace", 1e-3)
    assert 8 * t.batch_size * d.max_len == 262_144 and 1536 <= t.num_anchors <= 2048


def test_every_value_has_its_source():
    for n, line in enumerate(RECIPE.read_text().splitlines(), 1):
        if re.match(r"^\s+\w+:\s*\S", line):
            assert re.search(r"#\s*(\[[RSOPD]\])+", line), f"line {n} cites no source: {line.strip()}"
