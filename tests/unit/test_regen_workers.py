"""Regeneration's workers (`data.regen_workers`): batches generated at once by threads of one
process give what one batch at a time gives, each with its own features, and a stop ends
them without running the rest."""
import threading

import pytest
import torch

from dflash.model import target as T
from dflash.prep import regenerate as R

pytestmark = pytest.mark.usefixtures("tmp_cache")


def _convs(n):
    return [[{"role": "user", "content": f"Question {i}: " + "tell me about dragons " * (1 + i % 5)},
             {"role": "assistant", "content": "x"}] for i in range(n)]


def test_workers_give_the_replies_and_features_of_one_batch_at_a_time(tiny):
    model, tok = tiny
    layer_ids = T.default_layer_ids(T.num_layers(model), 3)
    convs = _convs(7)
    got = {}
    for workers in (1, 2):
        feats: dict = {}
        out = R.regenerate(model, tok, convs, max_new_tokens=10, batch_size=2, layer_ids=layer_ids,
                           features=feats, workers=workers)
        got[workers] = ([c[-1]["token_ids"] for c in out], feats)
    assert got[2][0] == got[1][0]
    assert got[2][1].keys() == got[1][1].keys()
    for k, f in got[1][1].items():  # each batch's features are its own thread's forwards
        torch.testing.assert_close(got[2][1][k], f, atol=1e-5, rtol=1e-4)
    assert torch.get_num_threads() >= 1 and not [t for t in threading.enumerate() if t.name.startswith("regen")]


def test_a_stop_during_the_workers_runs_no_more_batches_and_ends_the_running_ones(tiny, monkeypatch):
    """The first finished batch's write raises (as a stop signal's KeyboardInterrupt would): the
    batches not started are dropped, the running ones end at their next step, no thread is left."""
    model, tok = tiny
    threads_before = torch.get_num_threads()
    calls, ended = [], []
    real = R._generate_left_padded

    def spy(model, prompts, pad, eos, max_new_tokens, device, layer_ids=None, stop=None):
        calls.append(len(prompts))
        # the first call short, the others long and without eos: one is running when the stop comes
        n = 1 if len(calls) == 1 else max_new_tokens
        out = real(model, prompts, pad, set(), n, device, layer_ids, stop=stop)
        ended.append(max(map(len, out[0])))
        return out

    class Cache:  # regen_cache's interface, the write raising
        def load(self, keys, **kw):
            return {}

        def write_batch(self, batch, feats):
            raise KeyboardInterrupt

    monkeypatch.setattr(R, "_generate_left_padded", spy)
    with pytest.raises(KeyboardInterrupt):
        R.regenerate(model, tok, _convs(20), max_new_tokens=400, batch_size=2, cache=Cache(), workers=2)
    for t in [t for t in threading.enumerate() if t.name.startswith("regen")]:
        t.join()  # a running batch ends at its next step: this returns
    assert len(calls) < 10  # of 10 batches: the ones not started never ran
    assert sum(n < 400 for n in ended) >= 2  # beside the short first one, a batch running at the stop ended early
    assert torch.get_num_threads() == threads_before
