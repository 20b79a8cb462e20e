"""The training-memory estimate a run is refused by (preflight/launch_checks.py): from the
config alone it counts what a built drafter really holds once an optimizer step has run
(weights, gradients, AdamW's moments, a draft vocabulary's frozen head), and the refusal is
one line naming the estimate and what the machine has."""
import pytest
import torch

from helpers import SMALL_DRAFTER
from dflash.model.architectures import make_drafter
from dflash.model.drafter import DrafterConfig
from dflash.preflight.checkpoint_files import parameter_count, training_bytes
from dflash.preflight.launch_checks import available_memory, training_memory_error


def _held_after_a_step(d) -> int:
    """Bytes of every parameter, gradient, optimizer state tensor and buffer after one AdamW step."""
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum(p.float().sum() for p in params).backward()
    opt.step()
    held = sum(p.numel() * p.element_size() * 2 for p in params)  # the weight and its gradient
    held += sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    return held + sum(b.numel() * b.element_size() for b in d.buffers())


@pytest.mark.parametrize("over", [
    {}, {"num_hidden_layers": 3}, {"copy_head": True}, {"draft_vocab_size": 20},
    {"arch": "dflash2", "conv_group_size": 8, "selector_rank": 16, "selector_top_k": 4, "num_hidden_layers": 2},
    {"arch": "dflash2", "conv_kernel_size": 3, "conv_group_size": 1, "selector_rank": 64, "selector_top_k": 4},
])
def test_the_estimate_is_what_a_built_drafter_holds(over):
    cfg = DrafterConfig(**(SMALL_DRAFTER | over))
    d = make_drafter(cfg)
    assert parameter_count(cfg.to_dict()) == sum(p.numel() for p in d.parameters() if p.requires_grad)
    held = _held_after_a_step(d)
    assert abs(training_bytes(cfg.to_dict()) - held) <= 0.02 * held, (training_bytes(cfg.to_dict()), held)


def test_the_refusal_names_the_estimate_and_what_there_is():
    fields = DrafterConfig(**(SMALL_DRAFTER | {"arch": "dflash2", "selector_rank": 64})).to_dict()
    need = training_bytes(fields)
    assert training_memory_error(fields, (need, "cpu has enough")) is None
    assert training_memory_error(fields, None) is None  # nothing known: nothing refused
    err = training_memory_error(fields, (need - 1, "cuda:0 has 0.0 GiB free of 80.0 GiB"))
    assert f"the drafter has {parameter_count(fields):,} parameters" in err and "cuda:0 has 0.0 GiB free" in err
    assert "model.selector_rank" in err and "\n" not in err


def test_the_host_figure_is_memavailable():
    free, said = available_memory("cpu")
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert abs(free - kb * 1024) < 2**30 and "MemAvailable" in said  # a moving figure: within a GiB
