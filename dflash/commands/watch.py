"""`dflash watch RUN_DIR`: a run's curves in TensorBoard (and MLflow's UI) on 127.0.0.1
(trackers/watch.py starts and stops the servers). torch-free; bad input is one line, exit 2."""
from __future__ import annotations


def add_parser(sub) -> None:
    w = sub.add_parser("watch", help="a run's curves in TensorBoard (and MLflow's UI) on 127.0.0.1")
    w.add_argument("run_dir", metavar="RUN_DIR", help="a run trained with --tracker tensorboard and/or mlflow")
    w.add_argument("--port", type=int, default=6006, help="TensorBoard's port (default 6006; taken: a free one; 0: any)")
    w.add_argument("--mlflow-port", type=int, default=5000,
                   help="MLflow UI's port for a local store (default 5000; taken: a free one; 0: any)")


def run(a) -> int:
    from ..trackers.watch import serve
    return serve(a)
