"""Data: conversations read without torch (conversations.py), tokenization and batching
(dataset.py), the batch a collate builds (batch.py). Nothing here runs a model: that is
prep/ (regeneration, the cached train/eval split)."""
