"""After (or beside) a run: stall attribution (stalls.py, idle_rules.py), timelines (timeline.py),
the summary report (report.py) and the learning-curve plot (learning_curve.py)."""
