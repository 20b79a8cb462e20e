from otel.trace_ids import KeyIds, random_span_id, root_span_id_for, trace_id_for


def test_trace_ids_are_deterministic_per_run_and_key():
    a = trace_id_for("run1", "batch", 17)
    assert a == trace_id_for("run1", "batch", 17)
    assert a != trace_id_for("run1", "batch", 18)
    assert a != trace_id_for("run2", "batch", 17)
    assert a != trace_id_for("run1", "step", 17)
    assert 0 < a < 2**128
    r = root_span_id_for("run1", "batch", 17)
    assert 0 < r < 2**64 and r == root_span_id_for("run1", "batch", 17)
    ids = KeyIds("run1")
    assert ids(("batch", 17)) == (a, r)
    assert 0 < random_span_id() < 2**64
