"""DFlash (z-lab, 2026): the backbone every family here builds on (model/drafter.py), with no
parts of its own. Its served format is z-lab's DFlashDraftModel (checkpoint/export_format.py)."""
from __future__ import annotations

from .base import Family


class DFlash(Family):
    name = "dflash"
    title = "a DFlash drafter"
    architecture = "DFlashDraftModel"

    def drafter_fields(self, model) -> dict:
        return {}  # a DFlash drafter's config.json stays what it always was: no "arch"


FAMILY = DFlash()
