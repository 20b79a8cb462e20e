"""A training run, one trainer for every placement (trainer.py): set up once (setup.py),
build the workers placement.py asks for and the channel between them (run_loop.py,
channels.py), finish. A batch goes: batch_source.py (data_load) -> target_worker.py
(model_forward, pack_hidden, cpu_copy_enqueue) -> channel -> drafter_worker.py (queue_get,
drafter_forward, backward, optimizer_step) -> step_end.py (metrics, progress, saving.py)."""
