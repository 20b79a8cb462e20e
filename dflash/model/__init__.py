"""The models: target loading (target.py), the DFlash drafter, its init and how a run builds
it (drafter*.py), one training step (drafter_trainer.py, lr_schedule.py, loss_vocab.py),
the target side of a step (features.py, feature_cache.py), checkpoints, CUDA warm-up,
speculative decoding and its eval."""
