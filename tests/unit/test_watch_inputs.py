"""`dflash watch` on a run whose local MLflow store is damaged: one line naming the file, before
any server starts (the servers themselves: tests/backends/test_trackers.py)."""
import pytest

from dflash.errors import ConfigError
from dflash.trackers.watch import servers


def test_a_damaged_mlflow_store_is_one_line(tmp_path):
    (tmp_path / "mlflow").mkdir()
    (tmp_path / "mlflow" / "mlflow.db").write_text("garbage, not a database\n")
    with pytest.raises(ConfigError, match=r"mlflow\.db: not an SQLite database"):
        servers(tmp_path)
    (tmp_path / "mlflow" / "mlflow.db").write_bytes(b"")  # a new, empty store: MLflow makes it
    assert [name for name, *_ in servers(tmp_path, mlflow_port=0)] == ["MLflow"]
