"""Data: documents, bad rows, packing, the stream arithmetic behind exact resume, the cache.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_data_e2e.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers import WIKI, cache_of, spec

from raytrain_cpu.data.prepare import _BlockWriter
from raytrain_cpu.data.sources import DataError, _group_wikitext, file_documents
from raytrain_cpu.data.stream import StreamPlan, document_positions, global_order, mix_pattern, mix_positions


def test_wikitext_articles_blank_lines_dropped():
    docs = _group_wikitext(WIKI.split("\n"))
    assert len(docs) == 2  # the sub-heading stays inside its article
    assert docs[0].startswith("= Alpha =") and "= = History = =" in docs[0] and "It is old" in docs[0]
    assert docs[1] == "= Beta =\nBeta too ."
    assert all("\n\n" not in d for d in docs)


def test_non_utf8_names_file_line_and_fix(tmp_path):
    raw = b"ok line\nsecond \xff\xfe bad\nthird\n"
    with pytest.raises(DataError, match=r"f.txt, line 2, column 8: not valid UTF-8.*data.bad_rows=skip"):
        file_documents("f.txt", raw, spec())
    docs, skipped = file_documents("f.txt", raw, spec(bad="skip"))
    assert skipped == 1 and "third" in docs[0] and "bad" not in docs[0]


def test_windows_files_read_as_unix_ones():
    """A byte-order mark and CRLF line ends (UTF-8 as Windows editors save it) give the same
    documents: the '\r' hid every heading (one document per file), and the BOM broke line 1's JSON."""
    windows = b"\xef\xbb\xbf" + WIKI.replace("\n", "\r\n").encode()
    docs, _ = file_documents("w.txt", windows, spec())
    assert len(docs) == 2 and (docs, 0) == file_documents("u.txt", WIKI.encode(), spec())
    jsonl = b'\xef\xbb\xbf{"text": "a b"}\r\n{"text": "c"}\r\n'
    assert file_documents("w.jsonl", jsonl, spec("jsonl", wikitext=False)) == (["a b", "c"], 0)


def test_jsonl_missing_field_and_bad_json():
    raw = b'{"text": "a b"}\n{"body": "c"}\n'
    with pytest.raises(DataError, match=r"d.jsonl, line 2: no 'text' field.*data.text_column"):
        file_documents("d.jsonl", raw, spec("jsonl", wikitext=False))
    with pytest.raises(DataError, match=r"line 1: not valid JSON"):
        file_documents("d.jsonl", b"{oops\n", spec("jsonl", wikitext=False))
    docs, skipped = file_documents("d.jsonl", raw + b"{oops\n", spec("jsonl", bad="skip", wikitext=False))
    assert docs == ["a b"] and skipped == 2


def test_a_json_array_file_reads_as_its_items():
    """One JSON array instead of JSON lines (Alpaca's alpaca_data.json, many exports): its items
    are the rows, and a bad item is named by its index."""
    docs, skipped = file_documents(
        "a.json", b'[\n {"text": "a b"},\n {"text": "c"}\n]\n', spec("jsonl", wikitext=False)
    )
    assert (docs, skipped) == (["a b", "c"], 0)
    with pytest.raises(DataError, match=r"a.json, item 1: no 'text' field"):
        file_documents("a.json", b'[{"text": "a"}, {"body": "b"}]', spec("jsonl", wikitext=False))
    with pytest.raises(DataError, match=r"a.json, line 2: not valid JSON"):
        file_documents("a.json", b'[{"text": "a"},\n {oops}]', spec("jsonl", wikitext=False))


def test_parquet_missing_column_and_null_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"content": ["x", None, "y"]}), path)
    with pytest.raises(DataError, match=r"p.parquet: no column 'text' \(columns: \['content'\]\)"):
        file_documents(str(path), path.read_bytes(), spec("parquet", wikitext=False))
    with pytest.raises(DataError, match=r"p.parquet, row 1: column 'content' is missing"):
        file_documents(str(path), path.read_bytes(), spec("parquet", column="content", wikitext=False))
    docs, skipped = file_documents(
        str(path), path.read_bytes(), spec("parquet", bad="skip", column="content", wikitext=False)
    )
    assert docs == ["x", "y"] and skipped == 1


def test_packing_has_no_padding_and_keeps_every_token(tmp_path):
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, size=n).astype(np.int32) for n in rng.integers(1, 40, size=200)]
    w = _BlockWriter(tmp_path / "train", seq_len=16)
    for d in docs:
        w.add(np.append(d, 0).astype(np.int32))  # 0 = EOS between documents
    tail = w.close()
    table = pq.read_table(tmp_path / "train")
    blocks = np.stack(table.column("input_ids").to_pylist())
    stream = np.concatenate([np.append(d, 0) for d in docs])
    assert blocks.shape[1] == 16 and tail == len(stream) % 16
    np.testing.assert_array_equal(blocks.reshape(-1), stream[: blocks.size])  # order kept, nothing padded
    assert table.column("block_id").to_pylist() == list(range(len(blocks)))


def test_cache_files_are_whole_and_blocks_are_read_by_each_files_own_rows(tmp_path, monkeypatch):
    """A document whose blocks cross a file's end goes on in the next file: each part file but the
    last holds BLOCKS_PER_FILE rows. The writer once put all of a document's blocks into the file
    it filled (up to 9,795 rows), and readers counting BLOCKS_PER_FILE a file read the wrong rows,
    then past the last file's end. Blocks are found by each file's own row count, so a cache
    written that way reads right too."""
    import pyarrow.parquet as pq

    from raytrain_cpu.data import prepare as data
    from raytrain_cpu.data import stream

    monkeypatch.setattr(data, "BLOCKS_PER_FILE", 8)
    seq, start = 4, 0
    writer = _BlockWriter(tmp_path / "new", seq)
    for n in (5, 7, 13):  # blocks a document: the second crosses block 8, the third 16 and 24
        writer.add(np.repeat(np.arange(start, start + n, dtype=np.int32), seq))  # block i holds i
        start += n
    writer.close()
    files = sorted((tmp_path / "new").glob("part-*.parquet"))
    assert [pq.ParquetFile(f).metadata.num_rows for f in files] == [8, 8, 8, 1]

    old = _BlockWriter(tmp_path / "old", seq)  # the old layout: files of 5, 12 and 8 rows
    old.blocks = [np.full(seq, i, dtype=np.int32) for i in range(25)]
    for n in (5, 12, None):
        old._flush(n)
    for split in ("new", "old"):
        ids = np.array([24, 0, 4, 5, 7, 8, 16, 17, 23, 9])
        got = stream.read_blocks(str(tmp_path / split), ids, has_labels=False)["input_ids"]
        np.testing.assert_array_equal(got, np.repeat(ids[:, None], seq, axis=1), err_msg=split)
        with pytest.raises(IndexError, match="outside the 25 blocks"):
            stream.read_blocks(str(tmp_path / split), np.array([25]), has_labels=False)


def test_decoded_columns_hold_the_windows_files_and_the_least_recent_go(tmp_path):
    """A file's columns stay decoded while its file is among the most recently read (three
    columns of a window's 8 files once did not fit 16 entries); a plan asks for its windows'."""
    from raytrain_cpu.data import stream as data

    c, d, e = (f"{cache_of(tmp_path / name, 30, 0)}/part-00000.parquet" for name in "cde")
    decoded = data._DecodedColumns(files=2)
    first = decoded(c, "input_ids")
    assert decoded(c, "input_ids") is first  # kept, not read again
    decoded(d, "input_ids")
    decoded(c, "input_ids")  # read again: now the most recent
    decoded(e, "input_ids")  # a third file: the least recent (d) goes
    assert list(decoded.held) == [c, e]
    decoded.keep(1)  # never fewer than asked before
    assert decoded.files == 2

    n = data.BLOCKS_PER_FILE
    plan = StreamPlan(("a", "b"), (10 * n, n // 2), 0, 8 * n, 8, 1, 0, 0, 64, pattern=(0, 1))
    assert plan.files_in_windows() == (8 + 1) + (1 + 1)  # a window and the file its edge cuts; all of b


def test_labels_shift_across_packed_block():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    x = torch.randint(0, 50, (2, 12))
    out = m(input_ids=x, labels=x)
    manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 50), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, manual)


def test_global_order_is_seeded_permutation_with_windows():
    a = global_order(1000, 7, 0, 64)
    assert sorted(a.tolist()) == list(range(1000))
    np.testing.assert_array_equal(a, global_order(1000, 7, 0, 64))
    assert not np.array_equal(a, global_order(1000, 7, 1, 64)) and not np.array_equal(a, global_order(1000, 8, 0, 64))
    # windowed: each run of 64 consecutive positions comes from one window of 64 block ids
    first = a[:64] if a[0] // 64 != 15 else a[: 1000 - 960]
    assert len(set((first // 64).tolist())) == 1


def _plan_positions(n, micro, world, start, end):
    out = []
    for r in range(world):
        p = StreamPlan(("unused",), (n,), 1, 64, micro, world, r, start, end)
        lo, hi = p.local_range
        out.append(p.positions(np.arange(lo, hi)))
    return out


@pytest.mark.parametrize(("micro", "world", "accum"), [(4, 2, 1), (2, 3, 2), (8, 1, 3)])
def test_ranks_disjoint_and_resume_is_exact(micro, world, accum):
    G, steps, stop = micro * world * accum, 10, 4
    full = _plan_positions(500, micro, world, 0, steps * G)
    allpos = np.concatenate(full)
    assert sorted(allpos.tolist()) == list(range(steps * G))  # disjoint, nothing missing
    first = _plan_positions(500, micro, world, 0, stop * G)
    rest = _plan_positions(500, micro, world, stop * G, steps * G)
    for r in range(world):
        np.testing.assert_array_equal(np.concatenate([first[r], rest[r]]), full[r])
    # each global step holds exactly the next G positions
    for s in range(steps):
        step_pos = np.concatenate([f[s * micro * accum : (s + 1) * micro * accum] for f in full])
        assert sorted(step_pos.tolist()) == list(range(s * G, (s + 1) * G))


def test_resume_with_other_world_size_continues_at_same_block():
    micro, stop = 4, 3
    before = np.concatenate(_plan_positions(100, micro, 2, 0, stop * 8))
    after = np.concatenate(_plan_positions(100, micro, 4, stop * 8, stop * 8 + 5 * 16))
    assert set(before.tolist()).isdisjoint(after.tolist())
    assert sorted(np.concatenate([before, after]).tolist()) == list(range(stop * 8 + 5 * 16))


def test_a_mixture_interleaves_by_share_and_each_source_runs_on():
    """Global positions share out by the pattern, evenly; each source's own positions run 0, 1, 2,
    ... whatever stretch of the stream is asked for, so a resume continues every source."""
    pattern = tuple(mix_pattern([3, 1]))
    assert pattern == (0, 0, 1, 0)
    assert mix_pattern([1, 1, 1]) == [0, 1, 2] and mix_pattern([1]) == [0]
    seven_three = mix_pattern([7, 3])
    for start in range(10):  # any 10 positions in a row hold 7 and 3: spread, not 7 then 3
        window = (seven_three * 2)[start : start + 10]
        assert window.count(1) == 3
    src, own = mix_positions(np.arange(4000), pattern)
    assert np.bincount(src).tolist() == [3000, 1000]
    for s in (0, 1):
        assert own[src == s].tolist() == list(range((src == s).sum()))
    assert mix_pattern([3, 0, 1]) == [0, 0, 2, 0]  # weight 0: evaluated only, never in the stream
    src0, own0 = mix_positions(np.arange(4000), tuple(mix_pattern([3, 0, 1])))
    np.testing.assert_array_equal(src0, np.where(src == 1, 2, 0))
    np.testing.assert_array_equal(own0, own)
    later_src, later_own = mix_positions(np.arange(1234, 2222), pattern)  # a resumed stretch
    np.testing.assert_array_equal(later_src, src[1234:2222])
    np.testing.assert_array_equal(later_own, own[1234:2222])


def test_a_mixture_plan_reads_each_source_through_its_own_epochs(tmp_path):
    """Two real caches, 3:1, the small one read many times over: each block's rows come from its
    source, block ids count on from the first source's, and each source goes through whole seeded
    epochs of its own (the small one a new order each time). Two workers read what one does."""
    dirs = (cache_of(tmp_path / "big", 40, 0), cache_of(tmp_path / "small", 5, 1000))
    micro, steps = 2, 10
    end = steps * micro * 2 * 2  # 2 workers x accumulation 2: 80 positions, 20 of the small source

    def plan(world: int, rank: int) -> StreamPlan:
        return StreamPlan(dirs, (40, 5), 7, 64, micro, world, rank, 0, end, pattern=(0, 0, 1, 0))

    rows = []
    for rank in (0, 1):
        p = plan(2, rank)
        rows.append(p.fetch({"id": np.arange(*p.local_range)}))
    by_pos = {
        int(pos): (int(b), int(ids[0])) for r in rows for pos, b, ids in zip(r["pos"], r["block_id"], r["input_ids"])
    }
    assert sorted(by_pos) == list(range(end))
    single = plan(1, 0).fetch({"id": np.arange(end)})
    assert [by_pos[int(p)][0] for p in single["pos"]] == single["block_id"].tolist()
    blocks = [by_pos[p][0] for p in range(end)]
    assert all((b < 40) == (p % 4 != 2) for p, b in enumerate(blocks))  # the pattern's slot 2: small
    assert all(value == (b if b < 40 else 1000 + b - 40) for b, value in by_pos.values())  # the right rows
    big, small = [b for b in blocks if b < 40], [b - 40 for b in blocks if b >= 40]
    assert big[:40] == global_order(40, 7, 0, 64).tolist() and big[40:] == global_order(40, 7, 1, 64)[:20].tolist()
    for epoch in range(4):  # the small source: 20 reads, 4 epochs of 5, each a permutation of its own
        assert small[epoch * 5 : (epoch + 1) * 5] == global_order(5, 7, epoch, 64).tolist()


def test_a_mixture_of_text_and_labelled_blocks_labels_the_text_with_its_inputs(tmp_path):
    """Chat examples (labels -100 off the responses) mixed with plain text: the stream carries
    labels for every block, the text's being its inputs (every token a target); asked for
    positions, the chat blocks' come from their examples, the text's from its EOS tokens."""
    from raytrain_cpu.data.prepare import _ExampleWriter

    chat = _ExampleWriter(tmp_path / "chat", 4, pad_id=0)
    for i in range(6):
        chat.add_example(np.array([1, 2, 3], dtype=np.int32) + 10 * i, np.array([-100, 2, 3], dtype=np.int32))
    chat.close()
    text = cache_of(tmp_path / "text", 6, 500)
    plan = StreamPlan((str(tmp_path / "chat"), text), (6, 6), 1, 64, 4, 1, 0, 0, 8, (0, 1), (True, False), 7)
    batch = plan.fetch({"id": np.arange(8)})
    is_text = batch["block_id"] >= 6
    assert is_text.tolist() == [False, True] * 4
    np.testing.assert_array_equal(batch["source"], is_text)  # each row's source: the loss by source
    np.testing.assert_array_equal(batch["labels"][is_text], batch["input_ids"][is_text])
    assert (batch["labels"][~is_text][:, :1] == -100).all() and (batch["labels"][~is_text][:, 1:3] >= 2).all()
    assert (batch["position_ids"][~is_text] == [0, 1, 2, 0]).all()  # an example of 3, then one pad
    np.testing.assert_array_equal(batch["position_ids"][is_text], document_positions(batch["input_ids"][is_text], 7))


def test_a_mixture_entrys_lines_carry_its_name_once():
    """An entry named for its format (chat.jsonl: "chat") logged "[data] chat: chat: ..."."""
    from raytrain_cpu.data.prepare import _log_named

    lines = []
    _log_named(lines.append, "chat", "[data] chat: 1,234 response tokens carry the loss")
    _log_named(lines.append, "wiki", "[data] 12 train / 2 eval blocks of 64 tokens")
    assert lines == [
        "[data] chat: 1,234 response tokens carry the loss",
        "[data] wiki: 12 train / 2 eval blocks of 64 tokens",
    ]


def test_document_positions_restart_after_each_eos():
    ids = np.array([[5, 0, 3, 4, 0, 0, 7], [1, 2, 3, 4, 5, 6, 0]])
    np.testing.assert_array_equal(document_positions(ids, 0), [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]])


def test_an_s3_object_rewritten_under_its_name_is_new_data_to_the_cache_key(make_config, tmp_path, monkeypatch):
    """Remote files were keyed by name alone: an S3 prefix whose objects were replaced trained on
    the old blocks, silently. Their listing's size and modification time now key them. A local
    filesystem stands in for S3 here (the same pyarrow FileSystem calls, no network)."""
    import os

    import pyarrow.fs as pafs

    from raytrain_cpu.data.prepare import cache_key
    from raytrain_cpu.data.sources import source_specs
    from raytrain_cpu.model.tokenizer import resolve_tokenizer_path

    bucket = tmp_path / "bucket"
    (bucket / "wiki").mkdir(parents=True)
    for name in ("a.jsonl", "b.jsonl"):
        (bucket / "wiki" / name).write_text('{"text": "Du Fu was a poet."}\n')

    class S3:  # FileSystem.from_uri: the bucket at a local folder
        from_uri = staticmethod(lambda uri: (pafs.LocalFileSystem(), str(bucket / uri.removeprefix("s3://b/"))))

    monkeypatch.setattr(pafs, "FileSystem", S3)

    def key():
        c = make_config("data.source=jsonl", "data.path=s3://b/wiki")
        train, evals = source_specs(c.data)
        assert train.paths == (f"s3://{bucket}/wiki/a.jsonl", f"s3://{bucket}/wiki/b.jsonl")
        return cache_key(c, train, evals, resolve_tokenizer_path(c.model.tokenizer, c.model.name_or_path))

    before = key()
    assert key() == before  # listed again, unchanged
    (bucket / "wiki" / "b.jsonl").write_text('{"text": "Li Bai was a poet."}\n')  # the same size, new content
    os.utime(bucket / "wiki" / "b.jsonl", ns=(10**18, 10**18))
    assert key() != before


# ----------------------------------------------------------------------------- a rank's batches, read in its own process


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_a_ranks_batches_are_its_plans_rows_in_micro_slices_however_far_read_ahead(tmp_path, prefetch):
    """train_batches: rank r's rows in order, `micro` at a time, the same read ahead or not; a
    restart's `skip` starts that many micro batches in; a consumer that stops early (an early stop)
    leaves no reader behind."""
    import threading

    from raytrain_cpu.data.stream import train_batches

    split = cache_of(tmp_path / "train", 50, 0)
    plan = StreamPlan((split,), (50,), 3, 64, 2, 2, 1, 8, 8 + 5 * 8)  # 2 workers, micro 2, 5 steps of 2 micro batches
    whole = plan.fetch({"id": np.arange(*plan.local_range)})
    batches = list(train_batches(plan, prefetch=prefetch))
    assert [len(b["pos"]) for b in batches] == [2] * 10
    for column, values in whole.items():
        np.testing.assert_array_equal(np.concatenate([b[column] for b in batches]), values)
    skipped = list(train_batches(plan, skip=4, prefetch=prefetch))
    assert [b["pos"].tolist() for b in skipped] == [b["pos"].tolist() for b in batches[4:]]
    early = train_batches(plan, prefetch=prefetch)
    next(early)
    early.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("raytrain-data")]


def test_a_read_that_fails_fails_the_consumer():
    from raytrain_cpu.data.stream import rank_batches

    def fetch(ids):
        if ids[0] >= 4:
            raise OSError(f"gone: {ids.tolist()}")
        return {"id": ids}

    got = rank_batches(fetch, 10, 2, prefetch=2)
    assert next(got)["id"].tolist() == [0, 1]
    next(got)
    with pytest.raises(OSError, match=r"gone: \[4, 5\]"):
        next(got)


@pytest.mark.parametrize("world", [2, 3])
def test_eval_streams_cover_every_block_once_whatever_the_worker_count(tmp_path, world):
    """7 eval blocks on 2 or 3 workers: every rank gets ceil(7 / W) rows (ZeRO-3 needs every rank
    in every forward), and together they hold every block once, as the one-process `evaluate`
    does. Rank r's stream stopped at 7 // W rows, leaving up to W-1 trailing blocks out, so the
    run's eval_loss depended on its worker count. A rank short of a block gets a padding row
    without targets (every label -100), and a text stream holding one carries labels for all its
    rows (their inputs), so its batches all have the same columns."""
    from raytrain_cpu.data.prepare import _ExampleWriter
    from raytrain_cpu.data.stream import EvalStream

    n_eval, seq = 7, 4
    cache_of(tmp_path / "text" / "eval", n_eval, 100, seq)  # block i holds 100 + i
    chat = _ExampleWriter(tmp_path / "chat" / "eval", seq, pad_id=0)
    chat_labels = [np.array([-100, 2 + 10 * i, 3 + 10 * i, 4 + 10 * i], dtype=np.int32) for i in range(n_eval)]
    for i, labels in enumerate(chat_labels):  # one example a block, filling it: its prompt takes no loss
        chat.add_example(np.array([1, 2, 3, 4], dtype=np.int32) + 10 * i, labels)
    chat.close()
    cases = [  # (cache, has_labels, documents_eos, each block's input_ids, its labels: None for text)
        (tmp_path / "text", False, None, lambda b: np.full(seq, 100 + b), None),
        (tmp_path / "text", False, 0, lambda b: np.full(seq, 100 + b), None),
        (tmp_path / "chat", True, None, lambda b: np.arange(1, 5) + 10 * b, lambda b: chat_labels[b]),
    ]
    per_rank = -(-n_eval // world)
    for cache, has_labels, eos, ids_of, labels_of in cases:
        seen = []
        for rank in range(world):
            batches = list(EvalStream(str(cache), world, rank, n_eval, 0, has_labels, eos).batches(2))
            assert len({tuple(sorted(b)) for b in batches}) == 1, "every batch of a rank has the same columns"
            rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
            assert len(rows["block_id"]) == per_rank, (cache.name, eos, rank)
            assert ("position_ids" in rows) == (eos is not None)
            padding = rows["block_id"] == -1
            if "labels" not in rows:  # a text stream without padding: the model's labels are its inputs
                assert not has_labels and not padding.any()
                rows["labels"] = rows["input_ids"]
            assert (rows["labels"][padding] == -100).all()
            real = rows["block_id"][~padding]
            assert real.tolist() == list(range(rank, n_eval, world))
            for b, ids, labels in zip(real, rows["input_ids"][~padding], rows["labels"][~padding]):
                np.testing.assert_array_equal(ids, ids_of(b))
                np.testing.assert_array_equal(labels, ids if labels_of is None else labels_of(b))
            seen += real.tolist()
        assert sorted(seen) == list(range(n_eval)), (cache.name, eos)
    # train.eval_batches cutting the streams short of the padding: no padding row, no labels for text
    for rank in range(world):
        (batch,) = EvalStream(str(tmp_path / "text"), world, rank, n_eval, per_rank - 1).batches(8)
        assert batch["block_id"].tolist() == list(range(rank, n_eval, world))[: per_rank - 1]
        assert "labels" not in batch


# ----------------------------------------------------------------------------- cache versions (no Ray)


@pytest.fixture
def fake_packing(monkeypatch):
    """_prepare_source without Ray or tokenization: each _pack call writes one part file naming the
    thread that packed it; `hold` (a barrier, a delay per thread) makes concurrent builds overlap."""
    import threading

    import ray

    from raytrain_cpu.data import prepare as data

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 1})
    state = {"hold": None, "delay": {}}

    def pack(spec, data_cfg, tokenizer, actors, out, eval_out, pad_id):
        if state["hold"] is not None:
            state["hold"].wait(timeout=30)
        time.sleep(state["delay"].get(threading.current_thread().name, 0.0))
        out.mkdir(parents=True)
        (out / "part-00000.parquet").write_text(threading.current_thread().name)
        return {"documents": 1, "tokens": 10, "blocks": 1, "skipped_rows": 0, "dropped_tail_tokens": 0}

    monkeypatch.setattr(data, "_pack", pack)
    return state


def _prepare_in_threads(cfg, n: int, force: bool = False) -> list:
    import threading

    from raytrain_cpu.data.prepare import prepare

    results: list = [None] * n

    def run(i: int) -> None:
        results[i] = prepare(cfg, force=force, log=lambda m: None)

    threads = [threading.Thread(target=run, args=(i,), name=f"job{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_two_jobs_preparing_one_key_at_once_end_with_the_same_whole_cache(make_config, tmp_path, fake_packing):
    """Both build (neither finds a cache), the first to publish wins and the other drops its own
    copy and reads the winner's: one version, whole, and nothing half-written left."""
    import threading

    fake_packing["hold"] = threading.Barrier(2)  # both are packing before either publishes
    cfg = make_config(f"data.cache_dir={tmp_path / 'cache'}")
    first, second = _prepare_in_threads(cfg, 2)
    assert first == second and (first / "meta.json").is_file() and (first / "train" / "part-00000.parquet").is_file()
    names = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name != "tokenizers")
    key = json.loads((first / "meta.json").read_text())["key"]
    assert names == [f"{key}.current", first.name]  # the loser's version is gone, no .tmp left


def test_two_forced_rebuilds_at_once_end_with_the_same_cache(make_config, tmp_path, fake_packing):
    import threading

    from raytrain_cpu.data.prepare import prepare, published_cache

    cfg = make_config(f"data.cache_dir={tmp_path / 'cache'}")
    old = prepare(cfg, log=lambda m: None)
    fake_packing["hold"] = threading.Barrier(2)
    fake_packing["delay"] = {"job1": 0.5}  # job0 publishes first; job1 finds its rebuild and takes it
    first, second = _prepare_in_threads(cfg, 2, force=True)
    assert first == second != old and published_cache(tmp_path / "cache", old.name.split(".")[0]) == first
    assert (first / "meta.json").is_file() and (old / "meta.json").is_file()


def test_a_forced_rebuild_never_moves_the_cache_a_run_reads(make_config, tmp_path, fake_packing):
    """--force used to delete the cache directory and rename a new one in its place: a run
    reading it died with FileNotFoundError. The rebuild is a new version; the old one stays."""
    from raytrain_cpu.data.prepare import prepare
    from raytrain_cpu.data.stream import read_meta

    cfg = make_config(f"data.cache_dir={tmp_path / 'cache'}")
    lines: list[str] = []
    old = prepare(cfg, log=lines.append)
    part = old / "train" / "part-00000.parquet"
    with open(part) as reading:  # a run holding a file open, and one that opens the next later
        new = prepare(cfg, force=True, log=lines.append)
        assert reading.read() == "MainThread"
    assert new != old and part.read_text() == "MainThread" and read_meta(old)["key"] == read_meta(new)["key"]
    assert any(f"the earlier cache {old} is left in place" in line for line in lines)
    assert prepare(cfg, log=lines.append) == new  # the published version is the one found next


def test_a_cache_written_before_versions_is_read_and_never_replaced(make_config, tmp_path, fake_packing):
    from raytrain_cpu.data.prepare import prepare

    cfg = make_config(f"data.cache_dir={tmp_path / 'cache'}")
    built = prepare(cfg, log=lambda m: None)
    legacy = tmp_path / "cache" / json.loads((built / "meta.json").read_text())["key"]
    built.rename(legacy)  # the layout before versions: the cache at <key> itself, no pointer
    (tmp_path / "cache" / f"{legacy.name}.current").unlink()
    assert prepare(cfg, log=lambda m: None) == legacy
    new = prepare(cfg, force=True, log=lambda m: None)
    assert new != legacy and (legacy / "meta.json").is_file() and prepare(cfg, log=lambda m: None) == new


def test_an_s3_prefix_lists_only_its_sources_files(tmp_path, monkeypatch):
    """_expand_s3 listed every object under the prefix: a parquet source read README.md, _SUCCESS
    and Spark's .crc files as parquet. It keeps the kind's suffixes, as a local directory does."""
    import pyarrow.fs as pafs

    from raytrain_cpu.data.sources import _expand_s3

    bucket = tmp_path / "bucket"
    (bucket / "set" / "sub").mkdir(parents=True)
    for name in ("a.parquet", "sub/b.parquet", "README.md", "_SUCCESS", ".a.parquet.crc", "sub/part.parquet.crc"):
        (bucket / "set" / name).write_bytes(b"x")

    class S3:  # FileSystem.from_uri: the bucket at a local folder
        from_uri = staticmethod(lambda uri: (pafs.LocalFileSystem(), str(bucket / uri.removeprefix("s3://b/"))))

    monkeypatch.setattr(pafs, "FileSystem", S3)
    paths, versions = _expand_s3("s3://b/set", "parquet", "data.path")
    assert [p.removeprefix(f"s3://{bucket}/set/") for p in paths] == ["a.parquet", "sub/b.parquet"]
    assert len(versions) == 2
    (bucket / "only").mkdir()
    (bucket / "only" / "_SUCCESS").write_bytes(b"")
    with pytest.raises(DataError, match=r"data.path: 's3://b/only' holds no .parquet objects"):
        _expand_s3("s3://b/only", "parquet", "data.path")
