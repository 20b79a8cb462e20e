"""The models: target loading (target.py), the DFlash drafter, its init and how a run builds
it (drafter*.py), the loss vocabulary of a training step (loss_vocab.py; the step itself is run/step.py),
the target side of a step (features.py, feature_cache.py), checkpoints, CUDA warm-up,
speculative decoding and its eval."""
