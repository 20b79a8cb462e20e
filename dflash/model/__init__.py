"""The models: target loading (target.py), the DFlash drafter and its init (drafter*.py), one
training step (trainer.py), checkpoints, CUDA warm-up, speculative decoding and its eval."""
