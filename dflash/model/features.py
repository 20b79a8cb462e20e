"""The target side of a step: one forward capturing the selected layers (model_forward),
then only the valid tokens kept (pack_hidden); the drafter side unpacks them.

Nothing here reads a device tensor on the host: lengths are host ints carried by the batch.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from ..data.batch import Batch
from . import target as target_mod
from .target import FINAL, num_layers


def target_features(target, batch: Batch, layer_ids, device, cache=None, source: dict | None = None) -> torch.Tensor:
    """model_forward: one target forward, selected layers concatenated: [B, S, n*H].

    ``cache`` (a FeatureCache, `train.feature_cache`): a batch whose sequences were all seen
    before is assembled from it without a forward (the target is frozen), and a forward's
    rows are kept for next time. A batch that carries captured features (``dflash train
    --features``: data_load read them from disk) needs no forward: they go to the device.
    ``source`` (a dict, the span's attributes) gets ``features``: "captured", "cache" or
    "forward", so a trace tells a step that ran the target from one that did not."""
    source = {} if source is None else source
    if batch.features is not None:
        source["features"] = "captured"
        return batch.features.to(device, non_blocking=True)
    if cache is not None:
        hit = cache.assemble(batch)
        if hit is not None:
            source["features"] = "cache"
            return hit
    source["features"] = "forward"
    ids = batch.input_ids.to(device, non_blocking=True)
    am = batch.attention_mask.to(device, non_blocking=True)
    feats = capture(target, ids, am, layer_ids)
    if cache is not None:
        feats = cache.keep(batch, feats)
    return feats


# -- the capture forward: the selected layers only, stopping after the deepest -------------
# `target.capture_hidden` runs every layer with output_hidden_states and keeps all L + 1
# hidden states; the drafter reads n of them, the deepest at most L - 3 by default (a 36-layer
# target: layers 1, 17, 33). Here forward hooks keep the selected layers' outputs and the one
# on the deepest ends the forward (an exception the caller catches): the layers after it, the
# final norm and the other L + 1 - n hidden states are never computed or held. The outputs are
# the same tensors `hidden_states[i + 1]` holds, so the features are equal bit for bit
# (tests/unit/test_target.py). With `FINAL` among the ids (KL/LK: the final norm's output) the
# deepest is the last, and the forward runs to the end. Layer L - 1 (whose hidden_states entry
# has the final norm applied) keeps the plain forward.
#
# Target workers on one device share one model, so the hooks are installed once per model and
# never removed (adding hooks while another thread's forward walks them would race); each
# reads this thread's capture, if any, and does nothing otherwise.
STOP_EARLY = True  # False: capture_hidden's full forward (bench/recipe_step.py measures both)

_active = threading.local()
_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


class _Enough(Exception):
    """Raised by the deepest selected layer's hook: the rest of the forward is not needed."""


def _install(model) -> None:
    with _install_lock:
        if model in _installed:
            return
        layers = decoder_layers(model)
        for i, layer in enumerate(layers):
            layer.register_forward_hook(_hook(i))
        norm = final_norm(model)
        if norm is not None:
            norm.register_forward_hook(_hook(FINAL))
        _installed[model] = True


def _hook(layer_id: int):
    def hook(_mod, _inp, out):
        cap = getattr(_active, "capture", None)
        if cap is None or layer_id not in cap["want"]:
            return
        cap["got"][layer_id] = (out[0] if isinstance(out, tuple) else out).detach()
        if layer_id == cap["stop_at"]:
            raise _Enough
    return hook


def capture(model, input_ids, attention_mask, layer_ids) -> torch.Tensor:
    """`target.capture_hidden`'s features ``[B, S, n*H]`` from a forward that stops after the
    deepest selected layer (above); capture_hidden itself where hooks cannot serve the ids."""
    if not STOP_EARLY or not can_capture(model, layer_ids):
        return target_mod.capture_hidden(model, input_ids, attention_mask, layer_ids)
    try:
        _install(model)
    except ValueError:  # no list of decoder layers to hook (an unusual architecture): the plain forward
        return target_mod.capture_hidden(model, input_ids, attention_mask, layer_ids)
    want = set(layer_ids)
    stop_at = FINAL if FINAL in want else max(want)
    _active.capture = {"want": want, "stop_at": stop_at, "got": {}}
    backbone = model.base_model  # skips the lm_head entirely when the model has a backbone
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    if backbone is model:
        kwargs["logits_to_keep"] = 1
    try:
        with torch.no_grad():
            backbone(**kwargs)
    except _Enough:
        pass
    finally:
        got = _active.capture["got"]
        _active.capture = None
    return torch.cat([got[i] for i in layer_ids], dim=-1)


def pack(features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """pack_hidden: keep valid tokens only -> [sum(lengths), n*H]; host ints, no nonzero()."""
    return torch.cat([features[i, :n] for i, n in enumerate(lengths)], dim=0)


def unpack(packed: torch.Tensor, lengths: list[int], padded_len: int) -> torch.Tensor:
    out = packed.new_zeros(len(lengths), padded_len, packed.shape[-1])
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = packed[start:start + n]
        start += n
    return out


def replicate_target(target, device):
    """A frozen copy of the target on another device (one per extra target worker)."""
    import copy

    return copy.deepcopy(target).to(device)


# -- features kept from generate() ---------------------------------------------------------
# Keep the selected target layers' outputs from every forward a `generate()` call makes.
#
# Regeneration already runs the target over every token of a training sequence (the prompt
# in the prefill, each reply token as the next step's input), so it can keep the features
# the drafter trains on for free instead of a second, teacher-forced forward over the same
# tokens later. On 2 CPU cores that second pass cost about as much as the decoding itself.
#
# Feature of layer ``i`` = the output of decoder layer ``i`` = ``hidden_states[i + 1]`` of a
# plain forward (what `target.capture_hidden` returns), for every layer but the last, whose
# ``hidden_states`` entry has the final norm applied: a capture that includes it is refused.

def decoder_layers(model) -> nn.ModuleList:
    """The target's list of decoder layers (the ModuleList as long as the layer count)."""
    L = num_layers(model)
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == L:
            return mod
    raise ValueError(f"no list of {L} decoder layers found in {type(model).__name__}")


def final_norm(model):
    """The module whose output is the last hidden state the lm_head reads (``FINAL``), or None."""
    norm = getattr(model.get_decoder(), "norm", None) if hasattr(model, "get_decoder") else None
    return norm if isinstance(norm, nn.Module) else None


def can_capture(model, layer_ids) -> bool:
    """Layers below the last (whose ``hidden_states`` entry is the final norm's output, not
    the layer's), and ``FINAL`` itself, read off the final norm."""
    return bool(layer_ids) and all(0 <= i < num_layers(model) - 1 or (i == FINAL and final_norm(model) is not None)
                                   for i in layer_ids)


class LayerCapture:
    """Context manager: forward hooks on the selected layers; ``calls[c]`` is the features
    of forward call ``c``, ``[B, T, n*H]`` on the model's device (the prefill first, then one
    per decoding step). Nothing is copied to the host here: the caller moves what it keeps.
    Only the forwards of the thread that made it are kept: threads that generate at once on
    one model (regeneration's workers) each hold a capture of their own."""

    def __init__(self, model, layer_ids):
        if not can_capture(model, layer_ids):
            raise ValueError(f"layer ids {list(layer_ids)}: capture needs layers below the last one")
        self._thread = threading.get_ident()
        self.layers = decoder_layers(model)
        self._model = model
        self.layer_ids = list(layer_ids)
        self.calls: list[torch.Tensor] = []
        self._pending: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def _hook(self, k: int):
        def hook(_mod, _inp, out):
            if threading.get_ident() != self._thread:  # another thread's forward on the same model
                return
            h = out[0] if isinstance(out, tuple) else out   # a tuple in older transformers
            self._pending[k] = h.detach()
            if len(self._pending) == len(self.layer_ids):  # the deepest selected layer has run
                parts = [self._pending.pop(j) for j in range(len(self.layer_ids))]
                self.calls.append(torch.cat(parts, dim=-1))
        return hook

    def __enter__(self) -> "LayerCapture":
        # one hook per entry: default_layer_ids may repeat a layer on tiny targets, and each
        # entry fills its own slot of the concatenation
        for k, i in enumerate(self.layer_ids):
            mod = final_norm(self._model) if i == FINAL else self.layers[i]  # FINAL runs after every layer
            self._hooks.append(mod.register_forward_hook(self._hook(k)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
