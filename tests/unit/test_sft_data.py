"""Chat and instruction data: rendering, loss masks token by token, packing, bad rows, the cache.

Masks are checked against the documented templates: the tokens of every example are split
into runs of trained / untrained tokens, and each run must decode to exactly the text the
template puts there (the response and its end-of-turn, or the prompt around it).
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_sft_data_e2e.py."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from helpers import GOOD, runs

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.data import DataConfig
from raytrain_cpu.data.prepare import Tokenize, _ExampleWriter
from raytrain_cpu.data.sft import IGNORE, example_tokens, row_messages
from raytrain_cpu.data.sources import DataError, SourceSpec, file_examples
from raytrain_cpu.model.chat import PLAIN_TEMPLATE, chat_template_for, render_generation_prompt, template_for_dir
from raytrain_cpu.model.tokenizer import BUNDLED_SFT, BUNDLED_TOKENIZER, EOS

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the article Du Fu about?"},
    {"role": "assistant", "content": "Du Fu was a Chinese poet."},
    {"role": "user", "content": "And his style?"},
    {"role": "assistant", "content": "Realist."},
]


# A ChatML-like template of the kind hub tokenizers carry (markers are plain text here).
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def cfg(fmt: str = "chat", **kw) -> DataConfig:
    return DataConfig(format=fmt, source="jsonl", path="rows.jsonl", **kw)


def encode(tok, eos_id, template, messages, train_on_prompt=False):
    text, spans = template.render(messages)
    ids, labels, prompt = example_tokens(tok.encode(text, add_special_tokens=False), spans, train_on_prompt, eos_id)
    return text, ids, labels, prompt


def own_template_tokenizer(tmp_path, template: str = CHATML):
    """A copy of the bundled tokenizer carrying its own chat template (no download)."""
    d = tmp_path / "tok"
    shutil.copytree(BUNDLED_TOKENIZER, d)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": template}))
    return d


# ----------------------------------------------------------------------------- masks, token by token


def test_chat_row_plain_template_masks_exactly_the_responses(tok, eos_id):
    template = template_for_dir(BUNDLED_TOKENIZER, cfg())
    assert template.source is None  # the bundled tokenizer has no template: the plain one
    text, ids, labels, prompt = encode(tok, eos_id, template, CHAT)
    assert text == (
        "<|system|>\nBe brief.\n<|user|>\nWhat is the article Du Fu about?\n<|assistant|>\n"
        f"Du Fu was a Chinese poet.{EOS}\n<|user|>\nAnd his style?\n<|assistant|>\nRealist.{EOS}"
    )
    assert runs(tok, ids, labels) == [
        (False, "<|system|>\nBe brief.\n<|user|>\nWhat is the article Du Fu about?\n<|assistant|>\n"),
        (True, f"Du Fu was a Chinese poet.{EOS}"),
        (False, "\n<|user|>\nAnd his style?\n<|assistant|>\n"),
        (True, f"Realist.{EOS}"),
    ]
    assert ids[-1] == eos_id and ids.count(eos_id) == 2  # ends with its (trained) EOS, none added
    assert prompt == labels.index(ids[prompt]) and all(lab == IGNORE for lab in labels[:prompt])


@pytest.mark.parametrize(
    "row, system, prompt_text, response",
    [
        ({"prompt": "Name a poet.", "response": "Du Fu.", "sys": "Be brief."}, "Be brief.", "Name a poet.", "Du Fu."),
        (  # Alpaca: instruction + input -> output, recognised without any column setting
            {"instruction": "Summarise the text.", "input": "Du Fu was a poet.", "output": "A poet."},
            None,
            "Summarise the text.\n\nDu Fu was a poet.",
            "A poet.",
        ),
    ],
    ids=["prompt-response", "alpaca"],
)
def test_instruction_rows_mask_all_but_the_response(tok, eos_id, row, system, prompt_text, response):
    c = cfg("instruction", system_column="sys")
    messages = row_messages(row, c)
    head = f"<|system|>\n{system}\n" if system else ""
    text, ids, labels, _ = encode(tok, eos_id, template_for_dir(BUNDLED_TOKENIZER, c), messages)
    assert text == f"{head}<|user|>\n{prompt_text}\n<|assistant|>\n{response}{EOS}"
    assert runs(tok, ids, labels) == [
        (False, f"{head}<|user|>\n{prompt_text}\n<|assistant|>\n"),
        (True, response + EOS),
    ]


def test_sharegpt_rows_are_chat_rows():
    """ShareGPT's `conversations` of {from, value} (human / gpt) read as {role, content} messages,
    with no column setting; a speaker it does not know keeps its name for the template to refuse."""
    row = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                             {"from": "gpt", "value": "Hello."}]}  # fmt: skip
    assert row_messages(row, cfg()) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
    ]
    odd = {"conversations": [{"from": "tool", "value": "42"}, {"from": "gpt", "value": "42."}]}
    assert row_messages(odd, cfg())[0]["role"] == "tool"


def test_an_alpaca_json_array_file_gives_its_examples():
    """alpaca_data.json as Stanford ships it: one JSON array of instruction/input/output rows."""
    import json

    from raytrain_cpu.data.sources import SourceSpec, file_documents

    rows = [
        {"instruction": "Name a poet.", "input": "", "output": "Du Fu."},
        {"instruction": "Say hi.", "output": "Hi."},
    ]
    spec = SourceSpec("jsonl", ("a.json",), "", False, "error", format="instruction")
    payloads, skipped = file_documents("a.json", json.dumps(rows, indent=2).encode(), spec, cfg("instruction"))
    assert skipped == 0 and [json.loads(x)["ref"] for x in payloads] == ["a.json, item 0", "a.json, item 1"]
    assert json.loads(payloads[0])["messages"][-1] == {"role": "assistant", "content": "Du Fu."}


def test_own_chat_template_masks_its_assistant_turns_and_matches_transformers(tok, eos_id, tmp_path):
    from transformers import AutoTokenizer

    d = own_template_tokenizer(tmp_path)
    template = template_for_dir(d, cfg())
    assert template.source == CHATML
    text, ids, labels, prompt = encode(tok, eos_id, template, CHAT)
    hf = AutoTokenizer.from_pretrained(str(d))
    assert text == hf.apply_chat_template(CHAT, tokenize=False)  # rendered as transformers renders it
    assert runs(tok, ids, labels) == [
        (
            False,
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nWhat is the article Du Fu about?<|im_end|>\n<|im_start|>assistant\n",
        ),
        (True, "Du Fu was a Chinese poet.<|im_end|>\n"),
        (False, "<|im_start|>user\nAnd his style?<|im_end|>\n<|im_start|>assistant\n"),
        (True, f"Realist.<|im_end|>\n{EOS}"),  # the template's end of turn, then the EOS packing relies on
    ]
    # generate renders a prompt exactly as training rendered it, with the run's template
    assert render_generation_prompt(hf, cfg(), messages=CHAT[:2]) == ids[:prompt]
    assert render_generation_prompt(hf, cfg(), messages=CHAT[:4]) == ids[: _trained_run_start(labels, 2)]


def test_train_on_prompt_trains_every_token(tok, eos_id):
    template = template_for_dir(BUNDLED_TOKENIZER, cfg())
    _, ids, labels, prompt = encode(tok, eos_id, template, CHAT, train_on_prompt=True)
    assert labels == ids
    _, _, _, masked_prompt = encode(tok, eos_id, template, CHAT)
    assert prompt == masked_prompt > 0  # the prompt is still measured (for the prompt >= seq_len check)


def test_generation_prompt_is_the_training_prefix_and_the_exported_template_renders_the_same(tok, eos_id):
    from transformers import AutoTokenizer

    c = cfg()
    template = template_for_dir(BUNDLED_TOKENIZER, c)
    hf = AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER))
    _, ids, labels, prompt = encode(tok, eos_id, template, CHAT)
    assert render_generation_prompt(hf, c, messages=CHAT[:2]) == ids[:prompt]
    assert render_generation_prompt(hf, c, messages=CHAT[:4]) == ids[: _trained_run_start(labels, 2)]
    q = "What is the article Du Fu about?"
    assert render_generation_prompt(hf, c, prompt=q) == tok.encode(f"<|user|>\n{q}\n<|assistant|>\n").ids
    # Export writes PLAIN_TEMPLATE into the tokenizer: apply_chat_template must give the same text.
    assert chat_template_for(hf, c) == PLAIN_TEMPLATE
    hf.chat_template = PLAIN_TEMPLATE
    for msgs in (CHAT, CHAT[:2], CHAT[:4]):
        for gen in (False, True):
            ours = template.render(msgs, add_generation_prompt=gen)[0]
            assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == ours
    assert render_generation_prompt(hf, c, messages=CHAT[:4]) == ids[: _trained_run_start(labels, 2)]


def _trained_run_start(labels, n: int) -> int:
    """Index of the first token of the n-th run of trained tokens (1-based)."""
    starts = [k for k, lab in enumerate(labels) if lab != IGNORE and (k == 0 or labels[k - 1] == IGNORE)]
    return starts[n - 1]


# ----------------------------------------------------------------------------- packing


def pack_and_check(tmp_path, window: int) -> float:
    """Packs random examples with _ExampleWriter, checks the blocks; returns the padding share."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    pad, seq = 0, 32
    examples = []
    for k, n in enumerate([*rng.integers(4, 20, size=60), 45, 32]):  # one longer than a block, one exactly one
        ids = np.concatenate([[1000 + k], rng.integers(1, 100, size=int(n) - 1)]).astype(np.int32)  # 1000+k marks it
        labels = np.where(np.arange(n) >= n // 2, ids, IGNORE).astype(np.int32)  # second half = response
        examples.append((ids, labels))
    w = _ExampleWriter(tmp_path / "train", seq, pad, window=window)
    for ids, labels in examples:
        w.add_example(ids, labels)
    w.close()
    table = pq.read_table(tmp_path / "train")
    blocks = np.stack(table.column("input_ids").to_pylist())
    block_labels = np.stack(table.column("labels").to_pylist())
    block_positions = np.stack(table.column("position_ids").to_pylist())
    for column in ("labels", "position_ids"):
        assert table.column(column).type.list_size == seq and str(table.column(column).type.value_type) == "int32"
    # Each block: whole examples (in data order), then padding; every example in exactly one block.
    # Positions count from each example's start, and from the padding's.
    seen = []
    for ids, labels, positions in zip(blocks, block_labels, block_positions):
        pos, in_block = 0, []
        while pos < seq and ids[pos] >= 1000:
            k = int(ids[pos]) - 1000
            n = min(len(examples[k][0]), seq)
            np.testing.assert_array_equal(ids[pos : pos + n], examples[k][0][:n])
            np.testing.assert_array_equal(labels[pos : pos + n], examples[k][1][:n])
            np.testing.assert_array_equal(positions[pos : pos + n], np.arange(n))
            in_block.append(k)
            pos += n
        assert in_block == sorted(in_block) and in_block
        assert (ids[pos:] == pad).all() and (labels[pos:] == IGNORE).all()  # padding: pad id, no loss
        np.testing.assert_array_equal(positions[pos:], np.arange(seq - pos))
        seen += in_block
    assert sorted(seen) == list(range(len(examples)))
    stats = w.stats()
    padding = int((blocks == pad).sum())  # real tokens are >= 1: every 0 is padding
    assert stats["truncated_examples"] == 1
    assert stats["padding_tokens"] == padding and stats["padding_frac"] == pytest.approx(padding / blocks.size)
    assert stats["loss_tokens"] == int((block_labels[:, 1:] != IGNORE).sum())
    if window == 1:  # greedy in order: the cache is the data's order
        assert seen == list(range(len(examples)))
    return stats["padding_frac"]


@pytest.mark.parametrize("window", [1, 4])
def test_packing_whole_examples_padded_truncation_counted(tmp_path, window):
    pack_and_check(tmp_path, window)


def test_first_fit_window_pads_less_than_in_order(tmp_path):
    fracs = [pack_and_check(tmp_path / str(w), w) for w in (1, 16)]
    assert fracs[1] < fracs[0] * 0.7, fracs


# ----------------------------------------------------------------------------- bad rows


def tokenize_rows(tok, eos_id, rows: list, fmt: str = "chat", bad_rows: str = "error", tokenizer_dir=None, **kw):
    """(table, skipped) of rows through file_examples and the Tokenize actor class, as prepare runs them."""
    c = cfg(fmt, bad_rows=bad_rows, **kw)
    spec = SourceSpec("jsonl", ("rows.jsonl",), "", False, bad_rows, format=fmt)
    raw = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode()
    payloads, skipped = file_examples("rows.jsonl", raw, spec, c)
    tdir = tokenizer_dir or BUNDLED_TOKENIZER
    actor = Tokenize(str(tdir / "tokenizer.json"), eos_id, sft=dataclasses.asdict(c))
    table = actor({"text": np.asarray(payloads, dtype=object), "skipped": np.zeros(len(payloads), dtype=np.int64)})
    return table, skipped + sum(table.column("skipped").to_pylist())


def test_row_without_messages_or_prompt_names_file_and_row(tok, eos_id):
    with pytest.raises(DataError, match=r"rows.jsonl, line 2: no 'messages' field \(has \['text'\]\).*bad_rows=skip"):
        tokenize_rows(tok, eos_id, [GOOD, {"text": "x"}])
    with pytest.raises(DataError, match=r"rows.jsonl, line 1: no 'prompt' field.*Alpaca"):
        tokenize_rows(tok, eos_id, [{"question": "q", "answer": "a"}], fmt="instruction")
    with pytest.raises(DataError, match=r"line 1: field 'response' is missing"):
        tokenize_rows(tok, eos_id, [{"prompt": "q"}], fmt="instruction")
    with pytest.raises(DataError, match=r"line 1: no assistant message"):
        tokenize_rows(tok, eos_id, [{"messages": [{"role": "user", "content": "Hi"}]}])
    # A string is not a list (it read as a JSON error about a valid line); JSON text of one is.
    with pytest.raises(DataError, match=r"line 1: 'messages' is a string, not a list of \{role, content\}"):
        tokenize_rows(tok, eos_id, [{"messages": "hello"}])
    assert tokenize_rows(tok, eos_id, [{"messages": json.dumps(GOOD["messages"])}])[1] == 0
    table, skipped = tokenize_rows(tok, eos_id, [GOOD, {"text": "x"}, "[1, 2]", GOOD], bad_rows="skip")
    assert skipped == 2 and len([x for x in table.column("ids").to_pylist() if x]) == 2
    # the prompt/response columns are configurable
    table, _ = tokenize_rows(
        tok, eos_id, [{"q": "Hi", "a": "Yo."}], fmt="instruction", prompt_column="q", response_column="a"
    )
    assert (
        tok.decode([t for t in table.column("labels")[0].as_py() if t != IGNORE], skip_special_tokens=False)
        == f"Yo.{EOS}"
    )


def test_an_empty_answer_is_a_bad_row_one_empty_turn_among_others_is_not(tok, eos_id):
    """A blank answer trained on the end of turn alone (the model learns to say nothing), silently."""
    blank = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " \n"}]}
    with pytest.raises(DataError, match=r"rows.jsonl, line 2: the assistant's answer is empty.*bad_rows=skip"):
        tokenize_rows(tok, eos_id, [GOOD, blank])
    with pytest.raises(DataError, match=r"line 1: the assistant's answer is empty"):
        tokenize_rows(tok, eos_id, [{"instruction": "Say nothing.", "input": "", "output": ""}], fmt="instruction")
    assert tokenize_rows(tok, eos_id, [GOOD, blank], bad_rows="skip")[1] == 1
    # a turn with no text (a tool call's) among answers that have some trains on the others
    tool_call = [{"role": "user", "content": "Add 2 and 2."}, {"role": "assistant", "content": ""}]
    table, skipped = tokenize_rows(tok, eos_id, [{"messages": tool_call + GOOD["messages"]}])
    assert skipped == 0 and "Hello." in tok.decode([t for t in table.column("labels")[0].as_py() if t != IGNORE])


def test_unknown_role_names_row_role_and_known_roles(tok, eos_id, tmp_path):
    narrator = {"messages": [{"role": "narrator", "content": "Once"}, *GOOD["messages"]]}
    with pytest.raises(
        DataError,
        match=r"rows.jsonl, line 2: role 'narrator' is not one the plain template knows "
        r"\(system, user, assistant\)",
    ):
        tokenize_rows(tok, eos_id, [GOOD, narrator])
    _, skipped = tokenize_rows(tok, eos_id, [GOOD, narrator], bad_rows="skip")
    assert skipped == 1
    # A template of its own: the role it rejects (raise_exception) ...
    with pytest.raises(DataError, match=r"line 1: the chat template rejects this conversation: Unknown role: narrator"):
        tokenize_rows(tok, eos_id, [narrator], tokenizer_dir=own_template_tokenizer(tmp_path / "a"))
    # ... or the one it silently drops.
    dropping = (
        CHATML.replace("{{ raise_exception('Unknown role: ' + m['role']) }}", "")
        .replace("{{ '<|im_start|>'", "{% if m['role'] in ['system', 'user', 'assistant'] %}{{ '<|im_start|>'")
        .replace("'<|im_end|>\\n' }}", "'<|im_end|>\\n' }}{% endif %}")
    )
    with pytest.raises(DataError, match=r"line 1: message 0's role 'narrator' is not one the chat template renders"):
        tokenize_rows(tok, eos_id, [narrator], tokenizer_dir=own_template_tokenizer(tmp_path / "b", dropping))


def test_prompt_longer_than_seq_len_is_a_bad_row_a_long_response_is_truncated(tok, eos_id):
    long_prompt = {"prompt": "word " * 40, "response": "ok"}
    with pytest.raises(
        DataError, match=r"line 2: its prompt alone takes \d+ tokens, so data.seq_len=32 leaves no room"
    ):
        tokenize_rows(tok, eos_id, [{"prompt": "q", "response": "a"}, long_prompt], fmt="instruction", seq_len=32)
    with pytest.raises(DataError, match=r"prompt alone"):  # measured even when the prompt is trained too
        tokenize_rows(tok, eos_id, [long_prompt], fmt="instruction", seq_len=32, train_on_prompt=True)
    table, skipped = tokenize_rows(tok, eos_id, [long_prompt], fmt="instruction", seq_len=32, bad_rows="skip")
    assert skipped == 1 and table.column("ids")[0].as_py() == []
    # A long response is not a bad row: the packer truncates it (tested above) and counts it.
    table, skipped = tokenize_rows(
        tok, eos_id, [{"prompt": "q", "response": "word " * 40}], fmt="instruction", seq_len=32
    )
    assert skipped == 0 and len(table.column("ids")[0].as_py()) > 32


# ----------------------------------------------------------------------------- config and cache key


def test_config_validation():
    with pytest.raises(ConfigError, match=r"data.format.*'chat' needs rows with fields"):
        DataConfig(format="chat", source="text", path="x.txt")
    with pytest.raises(ConfigError, match=r"data.format"):
        DataConfig(format="sharegpt")
    with pytest.raises(ConfigError, match=r"data.chat_template.*does not exist"):
        DataConfig(format="chat", chat_template="/nonexistent/t.jinja")
    DataConfig(format="instruction")  # bundled: the shipped examples
    assert (BUNDLED_SFT / "chat_train.jsonl").is_file() and (BUNDLED_SFT / "instruction_eval.jsonl").is_file()


def test_cache_key_changes_with_format_template_and_train_on_prompt(make_config, tmp_path):
    from raytrain_cpu.data.prepare import cache_key
    from raytrain_cpu.data.sources import source_specs
    from raytrain_cpu.model.tokenizer import resolve_tokenizer_path

    jinja = tmp_path / "t.jinja"
    jinja.write_text(CHATML)

    def key(*overrides):
        c = make_config(*overrides)
        train, evals = source_specs(c.data)
        return cache_key(c, train, evals, resolve_tokenizer_path(c.model.tokenizer, c.model.name_or_path))

    keys = [
        key(),
        key("data.format=chat"),
        key("data.format=instruction"),
        key("data.format=chat", "data.train_on_prompt=true"),
        key("data.format=chat", f"data.chat_template={jinja}"),
    ]
    assert len(set(keys)) == len(keys)
    assert key("data.format=chat") == keys[1]  # and stable
