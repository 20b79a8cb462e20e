"""Regeneration keeps the target features it computes: with `train.feature_cache`, training
never runs the target's forward on a regenerated sequence, and a second run finds the
features on disk next to the replies."""
import torch

from dflash.config import load_config
from dflash.data import dataset as data_mod
from dflash.prep.prepare import prepare
from dflash.model import target as target_mod
from dflash.model.feature_cache import FeatureCache
from dflash.model.features import target_features


def test_training_batches_come_from_regeneration_features(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    cfg = load_config(None, ["model.target=tiny-qwen3", "data.num_conversations=12", "data.max_len=40",
                             "data.regen_max_new_tokens=24", "data.regen_max_prompt_len=32",
                             "model.block_size=4", "train.feature_cache=true", "data.regenerate=on"])
    target, tok = tiny
    ids = target_mod.default_layer_ids(target_mod.num_layers(target), 3)
    prep = prepare(cfg, target, tok, layer_ids=ids)
    assert prep.features and len(prep.features) >= len(prep.samples)
    cache = FeatureCache(ids)
    assert cache.preload(prep.features, cfg.data.max_len) == len(prep.features)

    from dflash.model import features as features_mod

    real = target_mod.capture_hidden
    forwards = []
    spy = features_mod.capture  # what target_features runs for a forward
    monkeypatch.setattr(features_mod, "capture", lambda *a, **k: forwards.append(1) or spy(*a, **k))
    stream = data_mod.batches(prep.samples, batch_size=2, seed=0, pad_id=tok.pad_token_id)
    for _ in range(len(prep.samples) // 2):
        b = next(stream)
        got = target_features(target, b, ids, "cpu", cache=cache)
        want = real(target, b.input_ids, b.attention_mask, ids)
        for r, n in enumerate(b.lengths):  # all but each sequence's last token, never a context
            torch.testing.assert_close(got[r, :n - 1], want[r, :n - 1], atol=2e-4, rtol=1e-3)
    assert not forwards, "a regenerated sequence ran the target's forward again"

    again = prepare(cfg, target, tok, layer_ids=ids)  # replies and features from the disk cache
    assert again.features is not None and again.features.keys() == prep.features.keys()
    k = next(iter(prep.features))
    torch.testing.assert_close(again.features[k], prep.features[k])
    assert prepare(cfg, target, tok).features is None  # no layers asked for: replies only


def test_a_replica_gets_its_own_feature_cache():
    """Each target device's replica gets the preloaded features itself (on its device), and
    the original keeps its own: a hit never hands a worker tensors from another device."""
    ids = [1, 2, 3]
    cache = FeatureCache(ids)
    rows = torch.randn(5, 3 * 256)
    assert cache.preload({(1, 2, 3, 4, 5): rows}, max_len=4) == 1
    replica = cache.replica("cpu")
    assert replica is not cache and len(cache) == len(replica) == 1
    (k, v), = replica._rows.items()
    torch.testing.assert_close(v, rows[:4])
    assert v.device == replica.device
