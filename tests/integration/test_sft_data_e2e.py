"""Chat and instruction data: rendering, loss masks token by token, packing, bad rows, the cache.

Masks are checked against the documented templates: the tokens of every example are split
into runs of trained / untrained tokens, and each run must decode to exactly the text the
template puts there (the response and its end-of-turn, or the prompt around it).
This module's in-process tests: tests/unit/test_sft_data.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import GOOD, runs

from raytrain_cpu.data.sft import IGNORE
from raytrain_cpu.data.sources import DataError
from raytrain_cpu.model.tokenizer import BUNDLED_SFT, EOS

# ----------------------------------------------------------------------------- prepare through Ray


@pytest.mark.slow
def test_prepare_chat_cache_has_labels_streams_yield_them_bad_rows(ray_session, make_config, tmp_path, tok, eos_id):
    import pyarrow.parquet as pq

    from raytrain_cpu.data.prepare import prepare
    from raytrain_cpu.data.stream import EvalStream, StreamPlan, read_meta

    # The bundled chat examples, as tests/test_finetune.py trains on them (same key: the cache is shared).
    cache = prepare(make_config("data.format=chat", "data.seq_len=128"))
    meta = read_meta(cache)
    assert meta["data_format"] == "chat" and meta["skipped_rows"] == 0 and meta["eval_blocks"] > 0
    assert meta["train_source"]["paths"] == [str(BUNDLED_SFT / "chat_train.jsonl")]
    table = pq.read_table(cache / "train")
    assert table.column_names == ["block_id", "input_ids", "labels", "position_ids"]
    ids, labels = (np.stack(table.column(c).to_pylist()) for c in ("input_ids", "labels"))
    assert ids.shape == labels.shape == (meta["blocks"], 128) and str(table.column("labels").type.value_type) == "int32"
    assert ((labels == IGNORE) | (labels == ids)).all()
    # padding = the EOS-id tail of each block that takes no loss; meta counts it exactly
    pad = sum(
        next((k for k in range(128) if not (b[-1 - k] == eos_id and lab[-1 - k] == IGNORE)), 128)
        for b, lab in zip(ids, labels)
    )
    assert meta["padding_tokens"] == pad and meta["padding_frac"] == pytest.approx(pad / ids.size)
    assert 0 < meta["padding_frac"] < 0.3 and meta["truncated_examples"] >= 0
    assert meta["loss_tokens"] == int((labels[:, 1:] != IGNORE).sum())
    # every trained run is an assistant answer of the source file and its EOS
    answers = {
        m["content"]
        for line in (BUNDLED_SFT / "chat_train.jsonl").read_text().splitlines()
        for m in json.loads(line)["messages"]
        if m["role"] == "assistant"
    }
    checked = 0
    for b, lab in zip(ids, labels):
        for trained, text in runs(tok, b.tolist(), lab.tolist()):
            if trained and text.endswith(EOS):
                assert text[: -len(EOS)] in answers
                checked += 1
    assert checked > 100
    # the streams hand the labels to training, and the examples' positions where asked to
    # (data.attention_span=document: documents_eos given)
    positions = np.stack(table.column("position_ids").to_pylist())
    for documents_eos in (None, eos_id):
        plan = StreamPlan(
            (str(cache / "train"),),
            (meta["blocks"],),
            1234,
            65536,
            4,
            1,
            0,
            0,
            8,
            source_labels=(True,),
            documents_eos=documents_eos,
        )
        batch = plan.fetch({"id": np.arange(8)})
        np.testing.assert_array_equal(batch["labels"], labels[batch["block_id"]])
        np.testing.assert_array_equal(batch["input_ids"], ids[batch["block_id"]])
        ev = EvalStream(str(cache), 1, 0, meta["eval_blocks"], has_labels=True, documents_eos=documents_eos)
        ev = next(ev.batches(4))
        assert ev["labels"].shape == ev["input_ids"].shape and (ev["labels"] == IGNORE).any()
        assert ("position_ids" in batch) == ("position_ids" in ev) == (documents_eos is not None)
    np.testing.assert_array_equal(batch["position_ids"], positions[batch["block_id"]])

    # A bad row fails through Ray with its file, line and role, and leaves no cache behind
    # (skipping and counting bad rows is tested above without Ray: it is the same actor code).
    rows = [GOOD] * 40 + [{"messages": [{"role": "narrator", "content": "Once"}, *GOOD["messages"]]}]
    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    base = ["data.format=chat", "data.source=jsonl", f"data.path={src}", f"data.cache_dir={tmp_path / 'c'}"]
    with pytest.raises(DataError, match=r"rows.jsonl, line 41: role 'narrator' is not one the plain template knows"):
        prepare(make_config(*base))
    assert not list((tmp_path / "c").glob("*/meta.json")) and not list((tmp_path / "c").glob(".*tmp*"))
