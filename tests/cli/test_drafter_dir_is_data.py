"""A drafter dir is data, not instructions: `dflash eval --tracker` takes its destination
from the command line, the environment or the training run dir the user named, never from
a file inside a checkpoint or an export (a planted `mlflow_run.json` naming a SQLite file
elsewhere or a host gets nothing), and writes no tracker file into a served drafter dir."""
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from helpers import cli_before_torch, run_dflash, served_drafter


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_drafter(tmp_path_factory.mktemp("handed") / "drafter")


def _plant(d: Path, uri: str) -> None:
    (d / "mlflow_run.json").write_text(json.dumps({"run_id": "0" * 32, "experiment_id": "0", "tracking_uri": uri}))


def _no_tracker_env() -> dict:
    return {k: "" for k in os.environ if k.startswith(("MLFLOW_", "WANDB_"))}


@pytest.mark.parametrize("tracker", ["mlflow", "tensorboard"])
def test_a_handed_over_drafter_never_chooses_where_figures_go(tmp_path, served, tracker):
    pytest.importorskip(tracker)
    d = Path(shutil.copytree(served, tmp_path / "drafter"))
    elsewhere = tmp_path / "elsewhere"
    _plant(d, f"sqlite:///{elsewhere}/planted.db")
    before = sorted(os.listdir(d))
    out, lines = cli_before_torch("eval", "--checkpoint", d, "--target", "tiny-qwen3", "--tracker", tracker,
                                  env=_no_tracker_env())
    assert out == {"rc": 2, "torch": False} and len(lines) == 1, lines
    assert f"--tracker {tracker}" in lines[0] and "not inside a dflash training run dir" in lines[0], lines
    assert not elsewhere.exists() and sorted(os.listdir(d)) == before


class _Listener:
    """A loopback HTTP server that records every request: nothing may reach it."""

    def __init__(self):
        seen = self.seen = []

        class H(http.server.BaseHTTPRequestHandler):
            def _any(self):
                seen.append((self.command, self.path))
                self.send_response(500)
                self.end_headers()
            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_an_export_in_a_run_dir_logs_to_the_run_dirs_own_store_never_to_a_planted_one(tmp_path, served):
    """An export of ours inside a training run dir: the figures go to that run dir (its local
    store), never into the export; a planted mlflow_run.json names only which run, and one
    naming another store (a host, a SQLite file elsewhere) is refused: the figures go to the
    run dir's fallback file, with one line that says how to reach that store on purpose."""
    pytest.importorskip("mlflow")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".dflash-run").write_text(json.dumps({"written_by": "dflash train", "version": 1}))
    d = Path(shutil.copytree(served, run / "export"))
    listener = _Listener()
    elsewhere = tmp_path / "elsewhere"
    _plant(run, listener.url)
    _plant(d, f"sqlite:///{elsewhere}/planted.db")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "Say hello."}) + "\n")
    before = sorted(os.listdir(d))
    try:
        p = run_dflash("eval", "--checkpoint", d, "--target", "tiny-qwen3", "--tracker", "mlflow", "--prompts-from",
                       prompts, "--max-new-tokens", 8, "--baseline", "none", env=_no_tracker_env(), check=False)
    finally:
        listener.close()
    assert p.returncode == 0, p.stderr[-3000:]
    assert listener.seen == [] and not elsewhere.exists()
    assert sorted(os.listdir(d)) == before  # nothing written into the drafter dir
    assert "set MLFLOW_TRACKING_URI" in p.stderr, p.stderr[-2000:]
    recs = [json.loads(line) for line in (run / "mlflow_fallback.jsonl").read_text().splitlines()]
    assert recs[-1]["type"] == "summary" and recs[-1]["summary"]["tau"] > 0, recs
