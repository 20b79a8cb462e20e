"""A tracker that fails says so in one line: a library's multi-line text (pydantic's validation
report for WANDB_MODE=bogus, SQLAlchemy's for a damaged store) is cut to its first line."""
from dflash.trackers.sink import Sink, failure


def test_a_multi_line_library_error_is_one_line():
    e = ValueError("1 validation error for Settings\nmode\n  Input should be 'online' or 'offline'")
    assert failure(e) == "ValueError: 1 validation error for Settings ..."
    assert failure(KeyError()) == "KeyError" and "\n" not in Sink().why_open_failed(e)
