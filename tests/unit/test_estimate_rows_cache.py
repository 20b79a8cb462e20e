"""The held-out estimate's rows (run/acceptance_estimate.eval_prompt_rows): a run after the first
reads the target's greedy continuations from their cache (`RegenCache.for_continuations`)
instead of generating them again, and gets the same rows; an entry of another length is
generated again."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash.config import load_config
from dflash.prep.regen_cache import RegenCache, prompt_key
from dflash.run import acceptance_estimate as E

pytestmark = pytest.mark.usefixtures("tmp_cache")
BK, NEW, PROMPT = 4, 8, 40


def _convs(n):
    return [[{"role": "user", "content": f"Question {i}: " + "tell me about rivers " * (1 + i % 4)}] for i in range(n)]


def _rows(model, tok, convs, **kw):
    return E.eval_prompt_rows(model, tok, convs, n=len(convs), max_prompt_len=PROMPT, max_new_tokens=NEW,
                              block_size=BK, pad_id=tok.pad_token_id, batch_size=8, **kw)


def test_the_cache_gives_the_rows_generating_gives(tiny, tmp_path):
    model, tok = tiny
    convs = _convs(5)
    one = _rows(model, tok, convs)
    cache = RegenCache(tmp_path / "continuations")
    first = _rows(model, tok, convs, cache=cache)
    again = _rows(model, tok, convs, cache=cache)
    assert first.source["continuations_cached"] == 0 and again.source["continuations_cached"] == 5
    for r in (first, again):
        assert torch.equal(r.batch.input_ids, one.batch.input_ids)
        assert (r.start, r.stop) == (one.start, one.stop)


def test_an_entry_of_another_length_is_generated_again(tiny, tmp_path):
    model, tok = tiny
    convs = _convs(3)
    one = _rows(model, tok, convs)
    cache = RegenCache(tmp_path / "continuations")
    prompt = one.batch.input_ids[0, :one.start[0]].tolist()
    cache.write_batch({prompt_key(prompt): [5, 6, 7]})          # a continuation cut short
    got = _rows(model, tok, convs, cache=cache)
    assert got.source["continuations_cached"] == 0
    assert torch.equal(got.batch.input_ids, one.batch.input_ids)
    assert _rows(model, tok, convs, cache=cache).source["continuations_cached"] == 3


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_run(tiny, tmp_path, capsys):
    model, tok = tiny
    convs = _convs(2)
    (tmp_path / "a-file").write_text("")
    got = _rows(model, tok, convs, cache=RegenCache(tmp_path / "a-file" / "continuations"))
    assert torch.equal(got.batch.input_ids, _rows(model, tok, convs).batch.input_ids)
    assert "continuations were not cached" in capsys.readouterr().err


def test_the_cache_is_keyed_by_the_target_and_the_length(tiny, tmp_path):
    model, _ = tiny
    cfg = load_config(None, [])
    at = lambda c, n: RegenCache.for_continuations(tmp_path, c, model, n).dir  # noqa: E731
    assert at(cfg, 10) == at(cfg, 10) != at(cfg, 11)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target_seed=cfg.model.target_seed + 1))
    assert at(other, 10) != at(cfg, 10)
