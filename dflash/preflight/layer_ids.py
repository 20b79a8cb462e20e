"""Which target layers feed the drafter, by the DFlash recipe. Torch-free, so the CLI can
check a resume or an explicit list before any model loads."""
from __future__ import annotations

from ..errors import UserError


def num_target_layers_error(n: int, num_layers: int) -> str:
    return (f"model.num_target_layers={n}: expected an integer <= {num_layers} (the target has {num_layers} "
            f"decoder layers)")


def default_layer_ids(num_layers: int, n: int) -> list[int]:
    """``n`` target layers spread from layer 1 to layer L-3 (the DFlash recipe); ``[L//2]`` for n=1.

    Like the reference implementation this may repeat a layer when L-4 < n-1 (e.g. L=4).
    Layer id i means the output of decoder layer i: ``hidden_states[i + 1]``.
    """
    if n < 1:
        raise ValueError(f"number of target layers must be >= 1, got {n}")
    if num_layers < 1:
        raise ValueError(f"target has {num_layers} layers")
    if n > num_layers:  # more would fuse copies of the same layers: a typo, never a recipe
        raise UserError(num_target_layers_error(n, num_layers))
    if n == 1:
        ids = [num_layers // 2]
    else:
        ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    if any(not 0 <= i < num_layers for i in ids):
        raise ValueError(f"layer ids {ids} out of range for a {num_layers}-layer target (need n=1 or L >= 4)")
    return ids
