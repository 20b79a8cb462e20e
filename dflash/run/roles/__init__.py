"""Roles by rank under torchrun (`--layout target:N,drafter:M`): `layout.py` says which rank
does what and where batch g goes; `handoff.py` carries hidden states from target ranks to
drafter ranks (credits, headers, payloads over torch.distributed); `shards.py` rebuilds a
drafter shard's batches wherever they are needed; `sync_timing.py` measures DDP's wait.
The workers themselves are the same as in one process (run/workers.py), joined by the
ranks channel (run/channels.py)."""
