"""data.regen_engine (issue 39): vLLM's replies go to a cache dir of their own; HF's cache key
is what it was before the setting existed (caches already on disk stay valid)."""
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

from dflash.config import load_config
from dflash.prep.regen_cache import FORMAT, RegenCache


class _Config:
    def to_json_string(self):
        return '{"model_type": "qwen3"}'


def test_the_engine_keys_the_cache_and_hf_keeps_its_old_key(tmp_path):
    target = SimpleNamespace(config=_Config(), dtype="torch.float32")
    hf = load_config(None, [], **{"model.target": "tiny-qwen3"})
    vl = load_config(None, [], **{"model.target": "tiny-qwen3", "data.regen_engine": "vllm"})
    a, b = RegenCache.for_target(tmp_path, hf, target), RegenCache.for_target(tmp_path, vl, target)
    assert a.dir != b.dir
    arch = hashlib.sha256(_Config().to_json_string().encode()).hexdigest()
    old = json.dumps({"target": "tiny-qwen3", "target_seed": 0, "arch": arch, "dtype": "torch.float32",
                      "new": hf.data.regen_max_new_tokens, "v": FORMAT}, sort_keys=True)
    assert a.dir == Path(tmp_path) / hashlib.sha256(old.encode()).hexdigest()[:24]
