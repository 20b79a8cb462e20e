""".ci/run's report of the Collector/Jaeger build (.ci/go-build.sh, which it sources) is true:
a first build, a cached one and a failed one each said as what they were. The build is a
stand-in deploy/build.sh that writes what the real one writes: paths on stdout, "building
NAME -> PATH" on stderr (the line a status parser once took for the status)."""
import subprocess

import pytest

from helpers import ROOT

BUILD = {
    "first": 'echo "building otelcol -> /root/.cache/dflash/bin/dflash-otelcol-x (first time only)" >&2\n'
             'echo "built otelcol in 1 s" >&2\necho /root/.cache/dflash/bin/dflash-otelcol-x\nexit 0\n',
    "cached": "echo /root/.cache/dflash/bin/dflash-otelcol-x\necho /root/.cache/dflash/bin/jaeger-x\nexit 0\n",
    "failed": 'echo "building otelcol -> /root/.cache/dflash/bin/dflash-otelcol-x (first time only)" >&2\n'
              'echo "go: github.com/x@v1: dial tcp: lookup proxy.golang.org: no such host" >&2\nexit 1\n',
}


def _report(tmp_path, kind: str) -> list[str]:
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "build.sh").write_text(BUILD[kind])
    script = f'. {ROOT / ".ci" / "go-build.sh"}; go_build_start; go_build_report; echo "phase: $go_phase"'
    p = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


@pytest.mark.parametrize("kind,said", [("first", "phase: go-build built in "), ("cached", "phase: go-build cached")])
def test_a_build_that_worked_is_reported_as_one(tmp_path, kind, said):
    out = _report(tmp_path, kind)
    assert not [ln for ln in out if "warning" in ln], out
    assert len(out) == 1 and out[0].startswith(said), out


def test_a_failed_build_is_a_warning_naming_its_error(tmp_path):
    out = _report(tmp_path, "failed")
    assert len(out) == 2, out
    assert out[0].startswith("warning: deploy/build.sh failed after ") and out[0].endswith(
        " s: go: github.com/x@v1: dial tcp: lookup proxy.golang.org: no such host"), out
    assert out[1].startswith("phase: go-build failed after "), out


def test_ci_run_reports_through_it():
    run = (ROOT / ".ci" / "run").read_text()
    assert ". .ci/go-build.sh" in run and "go_build_start" in run and "go_build_report" in run
