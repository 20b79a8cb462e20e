"""The GPUs the training process uses, as the exporter's NVML sampler addresses them.

Runs in the training process: only there does torch know its device indices' UUIDs.
The result travels in `ExportConfig.gpu_devices`."""
from __future__ import annotations

import os
import sys


def resolve_devices(gpu_indices) -> list[dict]:
    """torch device indices -> [{"index", "uuid" or None, "nvml_index" or None}].

    Prefers the UUID torch reports (exact whatever CUDA_DEVICE_ORDER is), else maps the
    index through CUDA_VISIBLE_DEVICES (an integer entry is an NVML index, a GPU-/MIG-
    entry a UUID)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else None
    torch = sys.modules.get("torch")  # only if the caller already imported it
    out = []
    for idx in gpu_indices:
        dev = {"index": int(idx), "uuid": None, "nvml_index": None}
        try:
            if torch is not None and torch.cuda.is_available():
                uuid = str(torch.cuda.get_device_properties(idx).uuid)
                dev["uuid"] = uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid
        except Exception:
            pass
        if dev["uuid"] is None:
            if entries is None:
                dev["nvml_index"] = int(idx)
            elif idx < len(entries):
                e = entries[idx]
                if e.isdigit():
                    dev["nvml_index"] = int(e)
                else:
                    dev["uuid"] = e
        out.append(dev)
    return out
