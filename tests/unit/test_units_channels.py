"""The two channels (run/channels.py) implement one interface, the `Channel` protocol:
checked at run time (`runtime_checkable`: every member present) and member by member, so a
method added to the protocol and forgotten in one channel fails here, not in a worker."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from dflash.config import PipelineConfig
from dflash.run.channels import Channel, QueueChannel, RankChannel

MEMBERS = sorted(n for n in dir(Channel) if not n.startswith("_")) + sorted(Channel.__annotations__)


def _channels():
    pcfg = PipelineConfig()
    side = SimpleNamespace(transport="gloo")
    return {"queue": QueueChannel(pcfg, torch.device("cpu")),
            "ranks": RankChannel(pcfg, torch.device("cpu"), target_side=side, index=0)}


@pytest.mark.parametrize("name", ["queue", "ranks"])
def test_each_channel_is_a_channel(name):
    ch = _channels()[name]
    assert isinstance(ch, Channel)
    missing = [m for m in MEMBERS if not hasattr(ch, m)]
    assert not missing, missing
    for m in MEMBERS:  # the same parameters as the protocol's (a self-explaining signature)
        proto = getattr(Channel, m, None)
        if callable(proto):
            assert list(inspect.signature(getattr(ch, m)).parameters) == \
                list(inspect.signature(proto).parameters)[1:], (name, m)
    ch.close()


def test_a_partial_channel_is_not_a_channel():
    class TakeOnly:
        span_attrs = {}

        def take(self, step):
            return None, 0.0

    assert not isinstance(TakeOnly(), Channel)
