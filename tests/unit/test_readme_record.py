"""Every figure README's first screen shows comes from one record (issue 55): the demos write
docs/records/NAME.json (dflash/analysis/demo_record.py) and README's table is generated from
them. This fails when the table and the records differ (a hand edit of either), and checks
that each record is one dated run on a named machine."""
from __future__ import annotations

import datetime
import json

from dflash.analysis import demo_record


def test_readmes_table_is_the_one_its_records_generate():
    text = demo_record.README.read_text()
    i, j = text.index(demo_record.BEGIN), text.index(demo_record.END) + len(demo_record.END)
    assert text[i:j] == demo_record.readme_block(demo_record.load()), (
        "README's demo table differs from docs/records/*.json: regenerate it with "
        "`python -m dflash.analysis.demo_record --readme-only` (or rerun the demo)")


def test_each_record_is_one_dated_run_on_a_named_machine():
    recs = demo_record.load()
    assert [r["name"] for r in recs][:2] == ["demo", "demo-long"]
    for r in recs:
        datetime.date.fromisoformat(r["date"])
        assert r["command"].startswith("make ") and r["wall_s"] > 0 and r["tau"]["drafter"]["per_step"] > 1
        assert r["machine"] and r["machine"].get("vllm_kernels") in ("_C", "_C_AVX512", "_C_AVX2"), r["name"]
        v = r["verdict"]
        if v is None:  # a demo run where no engine was set up: its taus and wall, no served speed
            continue
        for key in ("drafter_vs_none", "drafter_vs_ngram"):
            if v[key]["interval"] is not None:  # a paired verdict: the point inside its interval
                lo, hi = v[key]["interval"]
                assert lo <= v[key]["point"] <= hi and v["paired"], (r["name"], key)
        tps = v["tokens_per_s"]  # the ratios and the speeds are one run's
        assert abs(tps["drafter"] / tps["none"] - v["drafter_vs_none"]["point"]) < 0.02, r["name"]


def test_a_demo_run_writes_its_record_and_the_table_follows(tmp_path):
    """The record a demo writes from its summary.json (the paired verdict's intervals, its k,
    its machine), and the README table regenerated from it, in a scratch copy."""
    summary = {"wall_s": 109.4, "data": {"regenerated": 265, "regen_cached": 0, "regen_total": 265, "regen_s": 108.7},
               "eval_after": {"prompts": 16, "tau_per_step": 1.257, "acceptance_length": 1.395,
                              "baseline": {"tau_per_step": 1.509, "acceptance_length": 1.534}},
               "engine": {"version": "0.32.0", "prompts": 8, "rounds": 2, "paired": True, "wall_s": 231.0,
                          "machine": {"cpu": "AMD EPYC", "logical_cpus": 2, "vllm_kernels": "_C"},
                          "k_auto": {"runs/demo/export": {"k": 2, "block_k": 3}},
                          "methods": {
                              "none": {"k": None, "tokens_per_s": {"concurrency_1": 20.0}},
                              "ngram": {"k": 3, "tokens_per_s": {"concurrency_1": 29.0}},
                              "runs/demo/export": {"k": 3, "tokens_per_s": {"concurrency_1": 26.0},
                                                   "speedup_vs_none": {"concurrency_1": 1.3,
                                                                       "concurrency_1_interval": [1.25, 1.35]}},
                              "runs/demo/export (k=2, auto)": {
                                  "k": 2, "tokens_per_s": {"concurrency_1": 27.0}, "tau_per_step": 1.28,
                                  "lossless": True, "predicted_speedup_vs_none": 1.33,
                                  "speedup_vs_none": {"concurrency_1": 1.35, "concurrency_1_interval": [1.3, 1.4],
                                                      "held_out": {"point": 1.33, "interval": [1.31, 1.36],
                                                                   "half_width": 0.025, "decided": "faster",
                                                                   "prompts": 16, "timed_prompts": 8}},
                                  "speedup_vs_ngram": {"concurrency_1": 0.93,
                                                       "concurrency_1_interval": [0.9, 0.96],
                                                       "these_prompts": {"interval": [0.92, 0.94]}}}}}}
    rec = demo_record.from_summary(summary, name="demo", command="make demo", wall_s=519.2, date="2026-12-06")
    assert rec["verdict"]["k"] == 2 and rec["verdict"]["k_block"] == 3, "the served k is the picked one"
    assert rec["verdict"]["drafter_vs_none"] == {"point": 1.35, "interval": [1.3, 1.4], "held_out": {
        "point": 1.33, "interval": [1.31, 1.36], "prompts": 16}}, "over every held-out prompt too"
    assert rec["verdict"]["drafter_vs_ngram"]["these_prompts"] == [0.92, 0.94], "the machine's own interval, kept"
    assert rec["cache"].startswith("empty") and rec["wall_s"] == 519 and rec["phases_s"]["verdict"] == 231.0
    records = tmp_path / "records"
    demo_record.write(rec, records)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{demo_record.BEGIN}\n{demo_record.END}\n\nmore\n")
    assert demo_record.update_readme(readme, records) and not demo_record.update_readme(readme, records)
    row = readme.read_text().splitlines()[-4]
    assert row == ("| `make demo`, 2026-12-06 | **1.26 / 1.40** | 1.51 / 1.53 | 1.28 (k=2, 8 prompts) | "
                   "27.0 / 29.0 / 20.0 | "
                   "1.35x [1.30, 1.40]; all 16 prompts: 1.33x [1.31, 1.36] | 0.93x [0.90, 0.96] | 8 min 39 s, cache empty | "
                   "AMD EPYC, 2 CPUs, AVX-512 with BF16 kernels |"), row
    assert json.loads((records / "demo.json").read_text())["machine"]["cpu"] == "AMD EPYC"


def test_a_run_that_regenerated_most_of_its_replies_is_not_called_warm():
    """make demo-long after make demo found 162 of its 1,494 replies cached: "partly warm"."""
    from dflash.analysis.demo_record import _cache

    assert _cache({"regen_total": 1494, "regenerated": 1332, "regen_cached": 162}).startswith("partly warm: 162 of 1494")
    assert _cache({"regen_total": 282, "regenerated": 0, "regen_cached": 282}).startswith("warm: 282 of 282")
    assert _cache({"regen_total": 282, "regenerated": 282, "regen_cached": 0}).startswith("empty")
    assert _cache({"regen_total": 282, "regenerated": 270}).startswith("empty")  # 12 dropped, none cached
    assert _cache({}).startswith("n/a")  # no regeneration: not "warm"
    assert _cache({"regen_total": 282, "regenerated": 282, "regen_cached": 0}).startswith("empty")


def _scratch(tmp_path, monkeypatch):
    records, readme = tmp_path / "records", tmp_path / "README.md"
    records.mkdir()
    readme.write_text(f"# x\n\n{demo_record.BEGIN}\n{demo_record.END}\n\nmore\n")
    monkeypatch.setattr(demo_record, "RECORDS", records)
    monkeypatch.setattr(demo_record, "README", readme)
    return records, readme


def _run(tmp_path, summary) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "summary.json").write_text(json.dumps(summary))
    return run


VERDICTLESS = {"eval_after": {"prompts": 16, "tau_per_step": 1.25, "acceptance_length": 1.4}, "data": {}}


def test_bad_arguments_and_bad_input_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    """A record's name is a plain name (no path out of docs/records, no hidden file), the wall a
    finite count of seconds, the command one line; a summary that is not a finished `train
    --eval` run, or whose verdict failed, writes no record."""
    records, readme = _scratch(tmp_path, monkeypatch)
    before = readme.read_text()
    run = _run(tmp_path, VERDICTLESS)
    cases = [(["--name", "../../escaped"], "--name"), (["--name", "."], "--name"), (["--name", "a/b"], "--name"),
             (["--name", "x.json"], "--name"), (["--wall-s", "nan"], "--wall-s"), (["--wall-s", "-5"], "--wall-s"),
             (["--wall-s", "inf"], "--wall-s"), (["--command", "make a\nrm x"], "--command")]
    for extra, needle in cases:
        args = {"--name": "demo", "--command": "make demo", "--wall-s": "60"}
        for k, v in zip(extra[::2], extra[1::2]):
            args[k] = v
        rc = demo_record.main([str(run), *[x for kv in args.items() for x in kv]])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.count("\n") == 0 and needle in err, (extra, err)
    for summary, needle in (({}, "no eval after training"), ([1], "no eval after training"),
                            (VERDICTLESS | {"engine": {"error": "vLLM (none) exited with 1"}}, "verdict failed"),
                            (VERDICTLESS | {"eval_after": {"tau_per_step": "1.2"}}, "not a finished")):
        rc = demo_record.main([str(_run(tmp_path, summary)), "--name", "demo", "--command", "make demo"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and needle in err and err.count("\n") == 0, (summary, err)
    assert list(records.iterdir()) == [] and readme.read_text() == before
    assert not (tmp_path.parent / "escaped.json").exists()


def test_misplaced_markers_and_a_bad_record_are_named_and_readme_is_kept(tmp_path, monkeypatch, capsys):
    records, readme = _scratch(tmp_path, monkeypatch)
    swapped = f"# x\n{demo_record.END}\nkeep this\n{demo_record.BEGIN}\n"
    readme.write_text(swapped)
    assert demo_record.main(["--readme-only"]) == 2 and "expected one" in capsys.readouterr().err
    assert readme.read_text() == swapped
    readme.write_text(f"# x\n\n{demo_record.BEGIN}\n{demo_record.END}\n")
    (records / "stray.json").write_text('{"not": "a record"}')
    assert demo_record.main(["--readme-only"]) == 2
    err = capsys.readouterr().err
    assert "stray.json: not a demo record" in err and err.count("\n") == 1


def test_a_run_without_a_verdict_keeps_the_record_that_has_one(tmp_path, monkeypatch, capsys):
    """`make demo` on a machine where .venv-vllm did not build trains, but has no verdict: the
    measured record stays, and it says so; with no record yet the verdict-less one is written."""
    records, readme = _scratch(tmp_path, monkeypatch)
    run = _run(tmp_path, VERDICTLESS)
    assert demo_record.main([str(run), "--name", "demo", "--command", "make | demo"]) == 0
    assert json.loads((records / "demo.json").read_text())["verdict"] is None
    assert "`make \\| demo`" in readme.read_text(), "a | in the command stays inside its cell"
    measured = {"name": "demo", "verdict": {"k": 3, "lossless": False, "tau_per_step_vllm": 1.3, "prompts": 6}}
    (records / "demo.json").write_text(json.dumps(json.loads((records / "demo.json").read_text()) | measured))
    kept = (records / "demo.json").read_text()
    assert demo_record.main([str(run), "--name", "demo", "--command", "make demo"]) == 0
    assert "keeps the earlier run" in capsys.readouterr().err and (records / "demo.json").read_text() == kept
    assert demo_record.main(["--readme-only"]) == 0
    assert "NOT lossless" in readme.read_text(), "a served drafter that changed the output is said in its row"


def test_an_interval_end_that_rounds_to_one_keeps_a_third_decimal():
    """[1.0027, 1.115] excludes 1 (decided): the table must not print it as [1.00, 1.11]."""
    assert [demo_record._bound(x) for x in (1.0027, 0.9981, 1.0, 1.234, 0.9951)] == [
        "1.003", "0.998", "1.00", "1.23", "0.995"]
