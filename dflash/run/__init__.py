"""A training run, one `Trainer` for every placement (trainer.py): set up once (setup.py,
into a RunSpec and a RunState: context.py), build the workers placement.py asks for and the
channel between them (run_loop.py, channels.py), finish. A batch goes: workers.py's batch
source (data_load) -> TargetWorker (model_forward, pack_hidden, cpu_copy_enqueue) -> channel
-> DrafterWorker (queue_get, then step.py's drafter_forward, backward, optimizer_step) ->
StepEnd (metrics, progress, saving.py)."""
