"""bench/data_scale.py is user-facing too (issue 54): every argument is checked before any
stage starts, one line and exit 2 (it ended in KeyError, IndexError, ValueError, silently
trained 1 step for `regen:300x0`, and printed an empty table for a --work that is a file)."""
import subprocess
import sys

import pytest

from helpers import ROOT, load_bench


@pytest.mark.parametrize("args,needle", [
    (["capture"], "capture: --arm"),
    (["capture", "--arm", "regen"], "capture: --n"),
    (["capture", "--arm", "regen", "--n", "0"], "--n=0"),
    (["capture", "--arm", "read", "--n", "10", "--max-samples", "-1"], "--max-samples=-1"),
    (["train"], "train: --cells"),
    (["train", "--cells", "garbage"], "cell 'garbage'"),
    (["train", "--cells", "regen:abc"], "cell 'regen:abc'"),
    (["train", "--cells", "regen:300x0"], "cell 'regen:300x0'"),
    (["train", "--cells", "regen:1x1"], "cell 'regen:1x1'"),
    (["train", "--cells", "turbo:300x8"], "cell 'turbo:300x8'"),
    (["train", "--cells", "regen:300x8:seed=x"], "cell 'regen:300x8:seed=x'"),
    (["train", "--cells", "regen:300x8:colour=red"], "cell 'regen:300x8:colour=red'"),
    (["train", "--cells", "read+regen:300x8:from=nope"], "cell 'read+regen:300x8:from=nope'"),
    (["calibrate", "--threads", "a"], "--threads='a'"),
    (["calibrate", "--threads", "0"], "--threads='0'"),
    (["calibrate", "--units", "regen,dance"], "--units='regen,dance'"),
    (["table", "--work", "/etc/passwd"], "--work='/etc/passwd'"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, needle):
    if "--work" not in args:
        args = [*args, "--work", str(tmp_path)]
    p = subprocess.run([sys.executable, "bench/data_scale.py", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and p.stdout == "", (p.returncode, p.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing started


@pytest.mark.parametrize("stage", ["capture --arm regen --n 10", "train --cells regen:300x8", "walk", "table",
                                   "calibrate"])
def test_a_work_dir_without_its_earlier_stages_is_one_line(tmp_path, stage):
    """A --work without prep's pool (or, for table, without a walked cell) names what to run first."""
    p = subprocess.run([sys.executable, "bench/data_scale.py", *stage.split(), "--work", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and str(tmp_path) in lines[0], (p.returncode, p.stderr)


def test_table_base_must_be_a_walked_cell(tmp_path):
    (tmp_path / "runs").mkdir()
    for name in ("regen_300x8.json", "regen_300x8.walk.json"):
        (tmp_path / "runs" / name).write_text("{}")
    p = subprocess.run([sys.executable, "bench/data_scale.py", "table", "--work", str(tmp_path), "--base", "nope"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "--base='nope'" in lines[0] and "regen_300x8" in lines[0], p.stderr


def test_good_cells_parse_as_before():
    ds = load_bench("data_scale")
    c = ds.parse_cell("read+regen:1500x2:from=read:1500x8:seed=3")
    assert (c["arm"], c["n"], c["epochs"], c["seed"], c["init"]) == ("read+regen", 1500, 2.0, 3, "read_1500x8")
    assert ds.parse_cell("regen:300x0.5")["epochs"] == 0.5
