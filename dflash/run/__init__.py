"""A training run: train.py sets up a RunContext (context.py) and runs a loop (loop.py or pipeline.py).
A batch goes: prefetch thread (pipeline.py) -> target worker (pipeline.py, model/trainer.py) ->
hidden_queue.py -> drafter step (model/trainer.py) -> step_end.py (metrics, progress, saving.py)."""
