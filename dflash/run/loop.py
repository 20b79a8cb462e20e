"""The single-process reference loop: every stage in order on one thread.

It is the baseline the pipeline is checked against (same batches, same anchors, same
updates => the same loss trajectory) and the fallback for debugging.
"""
from __future__ import annotations

from ..errors import WorkerError, naming_stages
from ..model.trainer import pack, target_features, unpack
from .faults import inject
from .step_end import StepEnd


def run_reference(ctx) -> None:
    cfg, tel, st = ctx.cfg, ctx.tel, ctx.step
    stage = naming_stages(tel.stage)  # a failure names its stage
    dev = str(st.device)
    batches = ctx.batch_stream()
    end_step = StepEnd(ctx, "main")  # tokens, read-back, progress, save cadence: as in the pipeline
    try:
        while ctx.more_steps():
            step = st.step
            key = ("batch", step)  # batch id == the step that consumes it, as in the pipeline
            common = dict(worker="main", rank=ctx.rank, step=step, batch_id=step)
            with stage("data_load", trace=key, **common) as s:
                b = next(batches)
                s.set(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
                inject(cfg.pipeline, "data_load", step)
            attrs = dict(common, device=dev, tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
            with stage("model_forward", trace=key, **attrs):
                feats = target_features(ctx.target, b, ctx.layer_ids, ctx.target.device)
                inject(cfg.pipeline, "model_forward", step)
            with stage("pack_hidden", trace=key, **attrs):
                packed = pack(feats, b.lengths)
                inject(cfg.pipeline, "pack_hidden", step)
            with stage("drafter_forward", trace=key, **attrs):
                feats = unpack(packed.to(st.device), b.lengths, b.padded_len)
                loss, acc = st.forward(feats, b)
                inject(cfg.pipeline, "drafter_forward", step)
            with stage("backward", trace=key, **attrs):
                st.backward(loss)
                inject(cfg.pipeline, "backward", step)
            with stage("optimizer_step", trace=key, links=[key], **attrs):
                gnorm, nonfinite = st.optimizer_step(loss)
                inject(cfg.pipeline, "optimizer_step", step)
            end_step(step, b.tokens, loss, acc, gnorm, nonfinite)
    except Exception as e:  # same report as a pipeline worker's failure
        raise WorkerError.from_failure("main", e) from e
    finally:
        end_step.close()


