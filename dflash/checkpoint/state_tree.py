"""Optimizer / scheduler / RNG state saved without pickle: tensors in safetensors, the
tree around them in JSON.

`torch.load` of a pickle runs whatever the file asks for (`__reduce__` -> `os.system`),
and people share checkpoints. Here loading builds only dicts, lists, tuples, strings,
numbers, booleans, None and tensors, whatever the files say.

The JSON keeps what plain JSON would lose: non-string dict keys (an optimizer's state is
keyed by parameter index), tuples (Adam's betas) and tensors (a reference by name into
the safetensors file).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_TENSOR, _TUPLE, _ITEMS, _FLOAT = "__tensor__", "__tuple__", "__items__", "__float__"


class StateFormatError(ValueError):
    pass


def save(tree, tensors_path: Path, tree_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}

    def enc(node):
        if isinstance(node, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = node.detach().to("cpu").contiguous()
            return {_TENSOR: name}
        if isinstance(node, bool) or node is None or isinstance(node, (int, str)):
            return node
        if isinstance(node, float):  # JSON has no nan / inf: spelled out, read back exactly
            return node if math.isfinite(node) else {_FLOAT: repr(node)}
        if isinstance(node, tuple):
            return {_TUPLE: [enc(v) for v in node]}
        if isinstance(node, list):
            return [enc(v) for v in node]
        if isinstance(node, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in node):
                return {k: enc(v) for k, v in node.items()}
            return {_ITEMS: [[enc(k), enc(v)] for k, v in node.items()]}
        raise TypeError(f"training state: cannot store a {type(node).__name__} without pickle")

    skeleton = enc(tree)
    save_file(tensors, str(tensors_path), metadata={"format": "pt"})
    tree_path.write_text(json.dumps(skeleton))


def load(tensors_path: Path, tree_path: Path):
    from ..preflight.inputs import read_json, read_safetensors_header

    try:
        skeleton = read_json(tree_path, tree_path.name, StateFormatError)  # bounded in size and depth
        read_safetensors_header(tensors_path)  # a regular file (a FIFO would block the loader), whole
        tensors = load_file(str(tensors_path))
    except StateFormatError:
        raise
    except Exception as e:  # OSError, and safetensors' own SafetensorError for a corrupt file
        raise StateFormatError(f"{type(e).__name__}: {str(e)[:200]}") from None

    def dec(node):
        if isinstance(node, list):
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            return node
        if set(node) == {_TENSOR}:
            if node[_TENSOR] not in tensors:
                raise StateFormatError(f"tensor {node[_TENSOR]!r} is missing")
            return tensors[node[_TENSOR]]
        if set(node) == {_TUPLE}:
            return tuple(dec(v) for v in node[_TUPLE])
        if set(node) == {_FLOAT}:
            return float(node[_FLOAT])  # float() of a string: only numbers, never code
        if set(node) == {_ITEMS}:
            return {_hashable(dec(k)): dec(v) for k, v in node[_ITEMS]}
        return {k: dec(v) for k, v in node.items()}

    try:
        return dec(skeleton)
    except StateFormatError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:  # a tree dflash did not write
        raise StateFormatError(f"malformed {tree_path.name} ({type(e).__name__})") from None


def _hashable(k):
    if isinstance(k, (list, dict)) or isinstance(k, torch.Tensor):
        raise StateFormatError(f"a dict key of type {type(k).__name__}")
    return k
