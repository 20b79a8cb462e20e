"""What training from features needs of the target: its embedding and lm_head, nothing else.

The drafter embeds its block with the target's embedding and scores it with the target's
lm_head (both frozen); the decoder layers only made the features, which are on disk now.
So only those two tensors are read:

- a checkpoint in safetensors (a local dir, a hub id, the embedded SmolLM2): the model is
  built on the `meta` device (no memory) to learn the two modules' names, and only those
  tensors are read from the file(s) holding them (`safe_open`: the rest is never read; a
  hub id downloads the index and the shard(s) that hold them, not the whole model);
- a tiny target is built from its seed, whole (it is a few MB), and the pair taken from it.

Memory: vocab x hidden x bytes for each untied matrix. For a 27B target such as
Qwen3.5-27B (248,320 x 5,120, untied, bf16) that is 2 x 2.54 GB = 5.1 GB, against about
54 GB for the whole model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..model import target as target_mod


class HeadOnlyTarget(torch.nn.Module):
    """Stands where the target stands for the drafter's set-up: ``config``, ``device``,
    ``dtype``, ``get_input_embeddings()``, ``get_output_embeddings()``; with ``init_source``
    the target whose chosen layers `model.drafter_init=target` copies (model/build.py)."""

    def __init__(self, config, embed: torch.nn.Embedding, head: torch.nn.Linear, note: str,
                 init_source: torch.nn.Module | None = None):
        super().__init__()
        self.config, self.embed, self.head, self.note = config, embed, head, note
        self.__dict__["init_source"] = init_source  # not a submodule: read once at build time, never trained

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype


def load_head_only(spec: str, config, *, device="cpu", dtype=torch.float32, seed: int = 0,
                   init_for: tuple[list[int], int] | None = None) -> HeadOnlyTarget:
    """``init_for=(target_layer_ids, drafter layers)`` (`model.drafter_init=target`): also the
    decoder layers and final norm the drafter starts from (model/build.py's init_modules), read
    into a target built on `meta`: a few layers' weights, not the model's."""
    if spec in target_mod.TINY_TARGETS:
        model, _ = target_mod.load_target(spec, device=device, dtype=dtype, seed=seed)
        return HeadOnlyTarget(model.config, model.get_input_embeddings(), model.get_output_embeddings(),
                              f"tiny target {spec} built from seed {seed}", model if init_for else None)
    src = target_mod._smollm2_model_dir() if spec == target_mod.SMOLLM2 else _local_dir(spec)
    meta = _on_meta(config)
    embed_name, head_name, tied = _module_names(meta)
    init_names = _init_names(meta, *init_for) if init_for else []
    files = _files_holding(src, [embed_name, head_name, *init_names], repo=None if Path(spec).is_dir() else spec)
    from safetensors import safe_open

    from ..preflight.inputs import SafetensorsHeaderError, TargetSpecError, read_safetensors_header

    weights = {}
    for name, f in files.items():
        try:  # a header that lies is one line, not the loader's traceback
            read_safetensors_header(f)
        except (SafetensorsHeaderError, OSError) as e:
            raise TargetSpecError(f"target {spec!r}: {f.name} is not a whole safetensors file ({e})") from None
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            weights[name] = fh.get_tensor(name).to(device=device, dtype=dtype)
    if embed_name not in weights or (head_name not in weights and not tied):
        raise ValueError(f"target {spec}: no {embed_name} / {head_name} in its safetensors files")
    missing = [n for n in init_names if n not in weights]
    if missing:
        raise ValueError(f"target {spec}: no {missing[0]} in its safetensors files (model.drafter_init=target)")
    w = weights[embed_name]
    embed = torch.nn.Embedding(w.shape[0], w.shape[1], _weight=w, _freeze=True)
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=dtype)
    head.weight = embed.weight if head_name not in weights else torch.nn.Parameter(weights[head_name])
    head.requires_grad_(False)
    for name in init_names:  # into the meta target: the rest of it stays without storage
        mod, _, pname = name.rpartition(".")
        setattr(meta.get_submodule(mod), pname, torch.nn.Parameter(weights[name], requires_grad=False))
    read = sum(t.numel() * t.element_size() for t in weights.values())
    what = "embedding and lm_head" + (f", and the {len(init_names)} tensors model.drafter_init=target copies"
                                       if init_names else " only")
    return HeadOnlyTarget(config, embed, head, f"{what}: {read / 1e6:.1f} MB read from "
                                               f"{len(set(files.values()))} file(s) of {src}",
                          meta if init_for else None)


def _local_dir(spec: str) -> Path:
    if Path(spec).is_dir():
        return Path(spec)
    from huggingface_hub import hf_hub_download  # a hub id: the index, then only the shards needed
    try:
        return Path(hf_hub_download(spec, "model.safetensors.index.json")).parent
    except Exception:  # a single-file checkpoint
        return Path(hf_hub_download(spec, "model.safetensors")).parent


def _on_meta(config) -> torch.nn.Module:
    """The target built on `meta` (no memory): its module names and structure."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _module_names(m) -> tuple[str, str, bool]:
    """Parameter names of the embedding and lm_head of the target ``m`` (on `meta`)."""
    names = {id(mod): n for n, mod in m.named_modules()}
    e, h = m.get_input_embeddings(), m.get_output_embeddings()
    tied = h is not None and h.weight is e.weight
    return names[id(e)] + ".weight", (names[id(h)] + ".weight") if h is not None else "", tied


def _init_names(m, target_layer_ids, n: int) -> list[str]:
    """Parameter names of what `model.drafter_init=target` copies from the target ``m``."""
    from ..model.build import init_modules

    names = {id(mod): name for name, mod in m.named_modules()}
    return [f"{names[id(mod)]}.{p}" for mod in init_modules(m, target_layer_ids, n)
            for p, _ in mod.named_parameters()]


def _files_holding(src: Path, names: list[str], repo: str | None = None) -> dict[str, Path]:
    idx = src / "model.safetensors.index.json"
    if idx.is_file():
        from ..preflight.inputs import TargetSpecError, inside, read_json_object

        where = f"target {str(src)!r}"
        wmap = read_json_object(idx, where, TargetSpecError).get("weight_map")
        if not isinstance(wmap, dict):
            raise TargetSpecError(f"{where}: {idx.name} has no weight_map")
        out = {}
        for n in names:
            if n in wmap:
                # a shard the index names is opened only inside the model's dir
                f = inside(src, wmap[n], f"{where}: {idx.name}", TargetSpecError) if not repo else src / str(wmap[n])
                if not f.is_file() and repo:  # a hub snapshot: fetch just this shard
                    from huggingface_hub import hf_hub_download
                    f = Path(hf_hub_download(repo, wmap[n]))
                out[n] = f
        return out
    single = src / "model.safetensors"
    from safetensors import safe_open
    with safe_open(str(single), framework="pt") as fh:
        keys = set(fh.keys())
    return {n: single for n in names if n in keys}
