"""How this pipeline's stages map to busy time and idle causes (fed to otel.idle, which
knows no stage names of its own): used live by the telemetry thread and offline by
`dflash stalls` / `dflash timeline`."""
from otel import IdleRules

# every report shows these, in this order, even when one never occurs
IDLE_CAUSES = ("queue_empty", "queue_full", "data_wait", "host", "sync", "checkpoint", "other")

DFLASH_RULES = IdleRules(
    causes=IDLE_CAUSES,
    stage_causes={"queue_get": "queue_empty", "checkpoint": "checkpoint"},
    # the end of an enqueue spent blocked on a full queue is back-pressure
    carve_inside={"cpu_copy_enqueue": ("blocked_s", "queue_full"),
                  # DDP's all-reduce wait at the end of backward (drafter ranks of a layout)
                  "backward": ("sync_s", "sync")},
    # time right before a stage spent waiting: target for the prefetcher; prefetcher
    # for room in its (full) batch queue, i.e. it is ahead of the targets
    carve_before={"model_forward": ("data_wait_s", "data_wait"),
                  "data_load": ("blocked_before_s", "queue_full")},
    busy=frozenset({"data_load", "model_forward", "pack_hidden", "cpu_copy_enqueue",
                    "drafter_forward", "backward", "optimizer_step", "acceptance_estimate",
                    "checkpoint_write"}),
    ignore=frozenset({"skipped_step"}),
)
