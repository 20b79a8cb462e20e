"""Roles by rank under torchrun (`--layout target:N,drafter:M`): `layout.py` says which rank
does what and where batch g goes; `target_rank.py` makes hidden states and sends them
(`handoff.py`: credits, headers, payloads over torch.distributed) to `drafter_rank.py`,
which trains on them; `run.py` sets a rank up."""
