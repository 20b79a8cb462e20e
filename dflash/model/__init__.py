"""The networks, the target and its features: target loading (target.py), the DFlash
drafter and its copy head, how a run builds it (build.py), the training loss (losses.py)
and its vocabulary (loss_vocab.py; the step itself is run/step.py), the target side of a step
(features.py, feature_cache.py), CUDA warm-up. Decoding and checkpoints build on this
package (decode/, checkpoint/); it imports neither."""
