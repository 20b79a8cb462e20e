"""A training run, one `Trainer` for every placement (trainer.py): set up once (setup.py,
into a RunSpec and a RunState: context.py), build the workers placement.py asks for and the
channel between them (run_loop.py, channels.py), finish. A batch goes: workers.py's batch
source (data_load) -> TargetWorker (model_forward, pack_hidden, cpu_copy_enqueue) -> channel
-> DrafterWorker (queue_get, then `step`: step.py's drafter_forward with the loss of
model/objective.py, backward, optimizer_step) -> StepEnd (metrics, progress, readback.py,
saving.py). The reference loop (run_loop.py `reference_loop`) is the same without the
channel: `features = target.make(batch)`, `drafter.step(step_no, features)`."""
