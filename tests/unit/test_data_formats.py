"""Data files beyond ShareGPT's JSON array: JSON Lines, gzip, chat `messages` records with a
system prompt; unusable records are dropped and counted by reason, never a crash."""
import gzip
import json

import pytest

from dflash.data import conversations as C
from dflash.preflight.inputs import DatasetError, check_dataset_path
from helpers import UNUSABLE_RECORDS

CHAT = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                  {"role": "assistant", "content": "Hello."}]},
    {"conversations": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                       {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]},
    {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]},
]
BAD = UNUSABLE_RECORDS


def _write(path, records, *, jsonl: bool, gz: bool, garbage_line: bool = False):
    lines = [json.dumps(r) for r in records]
    if garbage_line:
        lines.insert(1, "{this is not json")
    text = "\n".join(lines) + "\n" if jsonl else json.dumps(records)
    (gzip.open(path, "wt", encoding="utf-8") if gz else open(path, "w", encoding="utf-8")).write(text)
    return path


@pytest.mark.parametrize("name,jsonl,gz", [("d.jsonl", True, False), ("d.jsonl.gz", True, True),
                                           ("d.json.gz", False, True), ("d.json", False, False)])
def test_every_file_kind_gives_the_same_conversations(tmp_path, monkeypatch, name, jsonl, gz):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    path = _write(tmp_path / name, CHAT + BAD, jsonl=jsonl, gz=gz)
    check_dataset_path(path)
    convs = C.load_conversations(path, limit=10, seed=0)
    assert len(convs) == 3
    by_first_user = {next(m["content"] for m in c if m["role"] == "user"): c for c in convs}
    assert by_first_user["Hi?"][0] == {"role": "system", "content": "Be brief."}  # the system prompt is kept
    assert [m["role"] for m in by_first_user["2+2?"]] == ["user", "assistant"] * 2
    assert by_first_user["Name a colour."][-1] == {"role": "assistant", "content": "Blue."}


def test_unusable_records_are_counted_by_reason(tmp_path):
    path = _write(tmp_path / "d.jsonl", CHAT + BAD, jsonl=True, gz=False, garbage_line=True)
    counts = C.drop_counts(C._iter_records(path))
    assert counts == {"not_json": 1, "not_a_conversation": 1, "no_assistant_turn": 1, "roles_out_of_order": 1,
                      "empty": 1, "too_large": 0}


def test_a_jsonl_file_that_is_not_jsonl_is_one_line(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text("[1, 2, 3]\n")
    with pytest.raises(DatasetError, match="not JSON Lines"):
        check_dataset_path(bad)


def test_a_glob_a_directory_and_a_list_name_several_files(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "shards"
    d.mkdir()
    _write(d / "a.jsonl", CHAT[:2], jsonl=True, gz=False)
    _write(d / "b.json.gz", CHAT[2:] + BAD, jsonl=False, gz=True)
    (d / "notes.txt").write_text("not data")
    want = sorted(map(json.dumps, C.load_conversations(f"{d / 'a.jsonl'},{d / 'b.json.gz'}", limit=10, seed=0)))
    for spec in (str(d), str(d / "*.*s*"), f"{d / 'a.jsonl'}, {d / 'b.json.gz'}"):
        got = C.load_conversations(spec, limit=10, seed=0)
        assert len(got) == 3 and sorted(map(json.dumps, got)) == want, spec
    with pytest.raises(DatasetError, match="the pattern matches no file"):
        check_dataset_path(str(d / "*.parquet"))
    with pytest.raises(DatasetError, match="a directory with no data file"):
        check_dataset_path(str(tmp_path / "cache"))


def test_parquet_and_a_saved_hugging_face_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    rows = [{"messages": r["messages"]} for r in CHAT[:1]] + [{"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(4)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for spec in (tmp_path / "d.parquet", tmp_path / "saved"):
        check_dataset_path(spec)
        convs = C.load_conversations(spec, limit=10, seed=0)
        assert len(convs) == 5 and any(c[0] == {"role": "system", "content": "Be brief."} for c in convs), spec


def test_data_inspect_reports_counts_lengths_loss_share_and_marked_examples(tmp_path):
    from helpers import last_json, run_dflash

    path = _write(tmp_path / "d.jsonl", CHAT + BAD, jsonl=True, gz=False, garbage_line=True)
    p = run_dflash("data", "inspect", path, "--max-len", 40, "--json", timeout=300)
    r = last_json(p.stdout)
    assert r["records_read"] == 8 and r["used"] == 3
    assert {k: v for k, v in r["dropped"].items() if k != "over_length"} == {
        "not_json": 1, "not_a_conversation": 1, "no_assistant_turn": 1, "roles_out_of_order": 1, "empty": 1,
        "too_large": 0}
    assert sum(r["token_length_histogram"].values()) == 3 and 0 < r["loss_share"] < 1
    assert len(r["examples"]) == 3 and all("[[" in e and "]]" in e for e in r["examples"])
    assert any("[[Hello.<|im_end|>]]" in e for e in r["examples"])  # the reply and its end-of-turn token
    assert "records read 8, used 3" in p.stdout
    bad = run_dflash("data", "inspect", tmp_path / "nope.jsonl", check=False)
    assert bad.returncode == 2 and "nope.jsonl" in bad.stderr


def test_data_inspect_of_nothing_usable_reports_why_and_exits_2(tmp_path):
    """A script's `dflash data inspect X && dflash train ...` stops where train would refuse."""
    from helpers import last_json, run_dflash

    path = _write(tmp_path / "d.jsonl", BAD, jsonl=True, gz=False, garbage_line=True)
    p = run_dflash("data", "inspect", path, "--json", check=False, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert last_json(p.stdout)["used"] == 0  # the report first: the reasons are its point
    assert "0 usable conversation(s) in" in p.stderr and "not_json 1" in p.stderr and "train would refuse it" in p.stderr


def test_a_lone_surrogate_escape_a_bom_and_a_cut_array_are_counted_not_crashes(tmp_path):
    """Valid JSON whose text no tokenizer takes (a lone "\\ud83d"), a UTF-8 byte-order mark, and
    a JSON array cut mid-record: dropped and counted as not_json, read, and counted."""
    surr = tmp_path / "s.jsonl"
    surr.write_text('{"messages": [{"role": "user", "content": "\\ud83d hi"}, {"role": "assistant", "content": "x"}]}\n'
                    + json.dumps(CHAT[2]) + "\n")
    assert [C.classify(r)[1] for r in C._iter_records(surr)] == ["not_json", None]
    bom = tmp_path / "b.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(r) for r in CHAT).encode())
    check_dataset_path(str(bom))
    assert [C.classify(r)[1] for r in C._iter_records(bom)] == [None, None, None]
    cut = tmp_path / "c.json"
    cut.write_text(json.dumps(CHAT)[:-20])
    assert [C.classify(r)[1] for r in C._iter_records(cut)] == [None, None, "not_json"]


def test_the_path_is_named_for_what_it_is(tmp_path):
    """A file whose name holds glob characters is that file; a dangling link and a zstd file are
    said as such, not as a missing file or a decoding error."""
    import os

    odd = _write(tmp_path / "br[1].jsonl", CHAT, jsonl=True, gz=False)
    check_dataset_path(str(odd))
    assert len(list(C._iter_records(odd))) == len(CHAT)
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "dangling.jsonl")
    with pytest.raises(DatasetError, match="a symbolic link that leads nowhere"):
        check_dataset_path(str(tmp_path / "dangling.jsonl"))
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(DatasetError, match="compressed as .zst, which is not read here"):
        check_dataset_path(str(tmp_path / "d.jsonl.zst"))
