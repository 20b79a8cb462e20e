"""The exporter side of otel: everything that looks at records one by one (profile, idle
attribution, counter sums, span building), the OpenTelemetry SDK pipeline, the file sink
and the NVML sampler. It runs in the exporter process (`python -m otel.exporter.process`),
or in the training process's background thread in thread mode. It never imports
otel.producer: batches reach it only through otel.transport."""
