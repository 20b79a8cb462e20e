"""z-lab's reference DFlash code (PyPI `dflash` 0.1.0), loaded for the tests.

Its import name is ours too, so the wheel's model.py is loaded under another module name.
The wheel is fetched once with pip into the DFLASH_CACHE dir; where it cannot be (no
network, no pip), `load()` returns None and the reason, and the tests skip saying it.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import zipfile

from dflash.preflight.inputs import cache_dir

VERSION = "0.1.0"
WHEEL = f"dflash-{VERSION}-py3-none-any.whl"


def _wheel():
    d = cache_dir() / "wheels"
    w = d / WHEEL
    if not w.is_file():
        d.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
                            f"dflash=={VERSION}", "-d", str(d)], capture_output=True, text=True, timeout=300)
        if not w.is_file():
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"pip download dflash=={VERSION} failed: {tail[0]}"
    return w, None


def load():
    """(the reference's model module, None) or (None, why it is unavailable)."""
    try:
        w, why = _wheel()
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"pip download dflash=={VERSION}: {type(e).__name__}: {e}"
    if w is None:
        return None, why
    src = cache_dir() / "wheels" / f"dflash-{VERSION}-model.py"
    if not src.is_file():
        with zipfile.ZipFile(w) as z:
            src.write_bytes(z.read("dflash/model.py"))
    spec = importlib.util.spec_from_file_location("zlab_dflash_reference_model", src)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # a transformers without what it imports
        return None, f"the reference model.py does not import here: {type(e).__name__}: {e}"
    # its timer calls torch.cuda.synchronize(), which fails without a GPU; timing is not compared
    mod._cuda_time = time.perf_counter
    return mod, None
