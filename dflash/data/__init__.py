"""Data: conversations, tokenization, regeneration and batching (dataset.py); the cached
train/eval split a run starts from (prepare.py)."""
