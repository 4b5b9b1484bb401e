"""Data: documents, bad rows, packing, the stream arithmetic behind exact resume, the cache.
This module's in-process tests: tests/unit/test_data.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers import WIKI

from raytrain_cpu.data.sources import DataError


@pytest.mark.slow
def test_prepare_cache_keyed_reused_and_bad_sources(ray_session, tmp_path, make_config, capfd):
    from raytrain_cpu.data.prepare import prepare
    from raytrain_cpu.data.stream import read_meta

    text = tmp_path / "corpus.txt"
    text.write_bytes(WIKI.encode() * 120 + b" = Gamma = \n bad \xff line\n ok line .\n")
    base = [f"data.cache_dir={tmp_path / 'cache'}", "data.source=text", f"data.path={text}", "data.seq_len=16"]
    capfd.readouterr()
    with pytest.raises(DataError, match=r"corpus.txt, line \d+, column \d+: not valid UTF-8"):
        prepare(make_config(*base))
    err = capfd.readouterr().err  # the one-line error only: not Ray Data's records of the task's stack
    assert "Traceback" not in err and "not valid UTF-8" not in err, err[-2000:]
    assert not list((tmp_path / "cache").glob("*/meta.json"))  # nothing half-written
    cfg = make_config(*base, "data.bad_rows=skip")
    cache = prepare(cfg)
    meta = read_meta(cache)
    assert meta["skipped_rows"] == 1 and meta["padding_tokens"] == 0 and meta["blocks"] > 0
    assert meta["eval_blocks"] > 0  # held out, by document
    mtime = (cache / "meta.json").stat().st_mtime
    assert prepare(cfg) == cache and (cache / "meta.json").stat().st_mtime == mtime  # reused, not rebuilt
    assert prepare(make_config(*base, "data.bad_rows=skip", "data.seq_len=32")) != cache  # keyed by seq_len
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    with pytest.raises(DataError, match="holds no text"):
        prepare(make_config(f"data.cache_dir={tmp_path / 'cache'}", "data.source=text", f"data.path={empty}"))
    # Compressed, as corpora ship: a directory's .txt.gz reads as the plain file; one cut short
    # (an interrupted download) is named in one line.
    import gzip

    (tmp_path / "packed").mkdir()
    packed = tmp_path / "packed" / "corpus.txt.gz"
    packed.write_bytes(gzip.compress(text.read_bytes()))
    gz = [*base[:2], f"data.path={packed.parent}", *base[3:], "data.bad_rows=skip"]
    assert {k: read_meta(prepare(make_config(*gz)))[k] for k in ("tokens", "blocks")} == {
        k: meta[k] for k in ("tokens", "blocks")
    }
    packed.write_bytes(gzip.compress(text.read_bytes())[:-100])
    capfd.readouterr()
    with pytest.raises(DataError, match=r"corpus.txt.gz: cannot decompress it \(.*\). Replace the file"):
        prepare(make_config(*gz))
    assert "Traceback" not in capfd.readouterr().err
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"body": "hello world " * 20}) for _ in range(30)))
    with pytest.raises(DataError, match=r"docs.jsonl, line 1: no 'text' field") as failed:
        prepare(make_config(f"data.cache_dir={tmp_path / 'cache'}", "data.source=jsonl", f"data.path={jl}"))
    # While the error is held (as pytest or a notebook holds it), no tokenizer actor keeps a CPU:
    # leaked ones once left the next run waiting forever for its training workers.
    assert failed.value is not None and _alive_tokenizer_actors(timeout=15) == []
    # A mixture's source that fails is named as its entry (a too-small one said only its tokens).
    (tmp_path / "tiny.txt").write_text("A few words.\n")
    mix = f"data.mix=[{{source: bundled, weight: 1}}, {{path: {tmp_path / 'tiny.txt'}, name: tiny, weight: 1}}]"
    with pytest.raises(DataError, match=r"^data.mix\[1\] \(tiny\): the training text gives \d+ tokens"):
        prepare(make_config(f"data.cache_dir={tmp_path / 'cache'}", mix))


def test_prepare_packs_a_directorys_files_in_order_and_may_hold_nothing_out(
    ray_session, tmp_path, make_config, monkeypatch
):
    """Files pack in their order, whichever tokenizing task ends first: `prepare` and `evaluate`
    once set Ray Data's preserve_order after building the dataset, which keeps the context it
    was built with, and packed other blocks (and held out other documents) on every build under
    the same key. data.eval_fraction=0 holds nothing out (it divided by zero)."""
    import ray

    from raytrain_cpu.data import prepare as data
    from raytrain_cpu.data.prepare import prepare
    from raytrain_cpu.data.stream import read_blocks, read_meta
    from raytrain_cpu.model.tokenizer import load_tokenizer, resolve_tokenizer_path

    # As a fresh `prepare` process has it (the session's runs set it for their own reads).
    monkeypatch.setattr(ray.data.DataContext.get_current().execution_options, "preserve_order", False)
    ordered = []  # what each dataset to pack holds: the order here depends on the tasks' timing

    def read_documents(*args, **kwargs):
        ds = read(*args, **kwargs)
        ordered.append(ds.context.execution_options.preserve_order)
        return ds

    read = data._read_documents
    monkeypatch.setattr(data, "_read_documents", read_documents)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    (tmp_path / "corpus").mkdir()
    for i, word in enumerate(words):  # the first file far the largest: its task ends last
        (tmp_path / "corpus" / f"{i}.txt").write_text(f"{' '.join([word] * 300)} .\n" * (60 if i == 0 else 1))
    cfg = make_config(
        f"data.cache_dir={tmp_path / 'cache'}",
        f"data.path={tmp_path / 'corpus'}",
        "data.seq_len=16",
        "data.eval_fraction=0",
        "data.tokenize_actors=2",
    )
    cache = prepare(cfg)
    meta = read_meta(cache)
    assert ordered == [True] and meta["eval_blocks"] == 0 and meta["eval_source"] == "none held out"
    tok = load_tokenizer(resolve_tokenizer_path("bundled", "tiny"))
    word_of = {tok(f" {w}", add_special_tokens=False)["input_ids"][0]: i for i, w in enumerate(words)}
    blocks = read_blocks(str(cache / "train"), np.arange(meta["blocks"]), False)["input_ids"]
    order = [word_of[t] for t in blocks.reshape(-1) if t in word_of]
    assert order == sorted(order) and set(order) == set(range(len(words)))


def _alive_tokenizer_actors(timeout: float) -> list[int]:
    import ray._private.state as state

    deadline = time.time() + timeout
    while True:
        alive = [
            a["Pid"] for a in state.actors().values() if a["State"] == "ALIVE" and "Tokenize" in a["ActorClassName"]
        ]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


def test_a_full_cache_filesystem_is_named_and_leaves_nothing(ray_session, tmp_path, make_config, monkeypatch):
    """ENOSPC (or a quota) while the blocks are written: one line naming data.cache_dir, and no
    half-written cache (pyarrow's OSError traceback before)."""
    import errno

    from raytrain_cpu.data import prepare as data

    def full(spec, data_cfg, tokenizer, actors, out, *rest):
        out.mkdir(parents=True)
        (out / "part-00000.parquet").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data, "_pack", full)
    cfg = make_config(f"data.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(DataError, match=r"^data.cache_dir: no space left in .*cache for the packed blocks"):
        data.prepare(cfg, log=lambda m: None)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # the .tmp copy is gone


def test_eval_examples_cut_to_seq_len_are_counted_too(ray_session, tmp_path, make_config):
    """Chat examples longer than data.seq_len are truncated to it and counted in meta.json's
    truncated_examples and on the console; the eval text's were truncated as silently: its
    count was dropped. meta.json's eval_truncated_examples counts them, from an eval file of
    its own and from the documents held out of the training text, and the console line says so."""
    from raytrain_cpu.data.cli import PREPARED_FIGURES
    from raytrain_cpu.data.prepare import prepare
    from raytrain_cpu.data.stream import read_meta

    def chat(answer: str) -> str:
        return json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]})

    short, long = chat("Hello."), chat("word " * 100)  # the long answer: well past 64 tokens
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("\n".join([short] * 30 + [long]) + "\n")
    evals.write_text("\n".join([short, long, short]) + "\n")
    base = ["data.format=chat", "data.source=jsonl", f"data.path={train}", "data.seq_len=64"]
    base.append(f"data.cache_dir={tmp_path / 'cache'}")
    lines: list[str] = []
    meta = read_meta(prepare(make_config(*base, f"data.eval_path={evals}"), log=lines.append))
    assert (meta["truncated_examples"], meta["eval_truncated_examples"]) == (1, 1)
    assert any(line.endswith("1 examples truncated to data.seq_len=64 (and 1 eval example)") for line in lines), lines
    # Held out of the training text (0.4: every 2nd document): the long 30th and 32nd, not the 33rd.
    train.write_text("\n".join([short] * 29 + [long, short, long, long]) + "\n")
    lines.clear()
    meta = read_meta(prepare(make_config(*base, "data.eval_fraction=0.4"), log=lines.append))
    assert (meta["truncated_examples"], meta["eval_truncated_examples"]) == (1, 2)
    assert any(line.endswith("(and 2 eval examples)") for line in lines), lines
    assert "eval_truncated_examples" in PREPARED_FIGURES
