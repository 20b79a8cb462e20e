"""--inject-delay / --inject-fault: reproducible stalls and failures, documented as tools
for testing dashboards, alerts, stall reports and the failure path."""
from __future__ import annotations

import time


class InjectedFault(RuntimeError):
    pass


def inject(pcfg, stage: str, step) -> None:
    if pcfg.inject_delay.get(stage):
        time.sleep(pcfg.inject_delay[stage])
    if stage in pcfg.inject_fault and step == pcfg.inject_fault[stage]:
        raise InjectedFault(f"injected fault in {stage} at step {step}")
