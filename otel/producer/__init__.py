"""The producer side of otel, in the training process: the facade (`Telemetry`), the hot
path (per-thread buffers, `Stage`, the CUDA event pool), the background thread, declared
instruments and the GPUs in use. It never imports otel.exporter: batches leave it only
through otel.transport."""
