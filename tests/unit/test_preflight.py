"""Checks the driver makes before Ray starts, against files already on disk (no training):
a resume whose model/data/batch settings differ from its checkpoint's (named key by key), a run
already finished, a run directory another job holds, a hub or S3 source that does not answer,
worker resources no node has, a data.seq_len longer than the model's context, a tokenizer that
outgrows the model's embedding, and a run whose planned memory does not fit its nodes or whose
checkpoints do not fit its storage.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_preflight_e2e.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import HUB_FILES, PUBLIC_DATASET, fake_run_dir, stub_hub_server

from raytrain_cpu.config.checks import ConfigError


def test_changed_settings_are_named_before_ray(make_config):
    from raytrain_cpu.launch.validate import validate_before_ray

    old = make_config("run.name=r")
    run_dir = fake_run_dir(old)
    validate_before_ray(old)  # the same settings resume
    # The step count, LR, logging and checkpoint cadence may change on a resume.
    validate_before_ray(make_config("run.name=r", "train.max_steps=500", "train.lr=1e-3", "train.checkpoint_every=7"))

    with pytest.raises(ConfigError) as e:
        validate_before_ray(make_config("run.name=r", "data.seq_len=32", "train.seed=7"))
    msg = str(e.value)
    assert msg.startswith(f"run.name: run 'r' resumes from {run_dir / 'checkpoint_000002'} (step 2)")
    assert "data.seq_len: 64 → 32; train.seed: 1234 → 7." in msg
    assert "run again with the old values (or choose a new run.name" in msg
    assert f"python -m raytrain_cpu.export {run_dir / 'checkpoint_000002'} <dir>" in msg
    assert "model.name_or_path=<dir>" in msg
    assert "train.max_steps" not in msg


def test_lora_settings_are_hashed_only_when_lora_is_on(make_config):
    """A LoRA checkpoint holds adapter state for its rank and targets: changing them (or turning
    LoRA off) can't resume; a full fine-tuning run hashes as before LoRA existed."""
    from raytrain_cpu.checkpoint.identity import config_hash
    from raytrain_cpu.launch.validate import validate_before_ray

    assert config_hash(make_config().to_dict()) == config_hash(make_config("lora.alpha=64").to_dict())
    fake_run_dir(make_config("run.name=r", "lora.rank=4"))
    validate_before_ray(make_config("run.name=r", "lora.rank=4", "train.max_steps=9"))
    with pytest.raises(ConfigError, match=r"lora.rank: 4 → 8"):
        validate_before_ray(make_config("run.name=r", "lora.rank=8"))
    with pytest.raises(ConfigError, match=r"lora.rank: 4 → \(unset\)"):
        validate_before_ray(make_config("run.name=r"))


def test_a_mixture_is_hashed_only_when_set_and_named_by_entry(make_config):
    """data.mix is part of the data a run trains on: a resume names the entry that changed, or
    how many there were; a run without one hashes as before mixtures existed."""
    from raytrain_cpu.checkpoint.identity import config_hash, hashed_settings
    from raytrain_cpu.launch.validate import validate_before_ray

    assert "mix" not in hashed_settings(make_config().to_dict())["data"]
    mix = "data.mix=[{source: bundled, weight: 1}, {source: bundled, name: again, weight: %s}]"
    fake_run_dir(make_config("run.name=r", mix % 3))
    validate_before_ray(make_config("run.name=r", mix % 3, "train.max_steps=9"))
    with pytest.raises(ConfigError, match=r"settings: data.mix\[1\].weight: 3.0 → 1.0\. Either"):
        validate_before_ray(make_config("run.name=r", mix % 1))
    with pytest.raises(ConfigError, match=r'settings: data.mix: "2 entries" → "1 entry"\. Either'):
        validate_before_ray(make_config("run.name=r", "data.mix=[{source: bundled, weight: 1}]"))
    assert config_hash(make_config(mix % 3).to_dict()) != config_hash(make_config(mix % 1).to_dict())


def test_a_checkpoint_from_before_attention_span_resumes_as_it_trained(make_config):
    """Checkpoints made before data.attention_span existed attended across documents: a text run
    resumes as before ('auto' is 'block' for text), a chat run is told to keep 'block'."""
    from raytrain_cpu.checkpoint.identity import config_hash
    from raytrain_cpu.launch.validate import validate_before_ray

    for fmt, changed in (("text", None), ("chat", 'data.attention_span: "block" → "document"')):
        old = make_config("run.name=r", f"data.format={fmt}").to_dict()
        del old["data"]["attention_span"]
        run_dir = fake_run_dir(make_config("run.name=r", f"data.format={fmt}"))
        manifest_path = run_dir / "checkpoint_000002" / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest_path.write_text(json.dumps(manifest | {"config_hash": config_hash(old)}))
        (run_dir / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
        if changed is None:
            validate_before_ray(make_config("run.name=r", f"data.format={fmt}"))
        else:
            with pytest.raises(ConfigError, match=changed):
                validate_before_ray(make_config("run.name=r", f"data.format={fmt}"))
            validate_before_ray(make_config("run.name=r", f"data.format={fmt}", "data.attention_span=block"))
        shutil.rmtree(run_dir)


def test_without_config_yaml_the_hashes_are_named(make_config):
    from raytrain_cpu.launch.validate import validate_before_ray

    run_dir = fake_run_dir(make_config("run.name=r"))
    (run_dir / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"config hash [0-9a-f]{16} → [0-9a-f]{16} \(.*config.yaml does not record"):
        validate_before_ray(make_config("run.name=r", "data.seq_len=32"))


def test_another_worker_count_must_keep_the_global_batch(make_config):
    """A resume may change the worker count (the checkpoint is converted) and how the global batch
    splits over the workers, never the global batch: the error names the setting that keeps it."""
    from raytrain_cpu.launch.validate import validate_before_ray

    fake_run_dir(make_config("run.name=r"), world=2)  # micro batch 4 x 2 workers: 8 blocks a step
    validate_before_ray(make_config("run.name=r", "scaling.num_workers=2"))
    validate_before_ray(make_config("run.name=r", "scaling.num_workers=1", "train.grad_accum_steps=2"))
    validate_before_ray(make_config("run.name=r", "scaling.num_workers=4", "train.micro_batch_size=2"))
    validate_before_ray(make_config("run.name=r", "train.micro_batch_size=2", "train.grad_accum_steps=2"))
    with pytest.raises(
        ConfigError,
        match=r"^scaling.num_workers: checkpoint .* trained with a global batch of 8 blocks \(2 workers\); 1 worker x "
        r"micro_batch_size 4 x grad_accum_steps 1 make 4\. Keep it with train.grad_accum_steps=2 or train.micro_batch_size=8\.",
    ):
        validate_before_ray(make_config("run.name=r", "scaling.num_workers=1"))
    with pytest.raises(
        ConfigError, match=r"8 blocks do not split over 3 workers; use a worker count that divides it \(1, 2, 4, 8\)"
    ):
        validate_before_ray(make_config("run.name=r", "scaling.num_workers=3"))
    with pytest.raises(
        ConfigError, match=r"^train.micro_batch_size: .* 2 workers x micro_batch_size 2 x grad_accum_steps 1 make 4"
    ):
        validate_before_ray(make_config("run.name=r", "train.micro_batch_size=2"))


def test_ranking_resumes_only_by_the_metric_its_checkpoints_were_scored_with(make_config, capsys):
    """Ray Train puts a checkpoint reported without a score first under a ranking, and compares
    scores of different metrics as one: the driver stops such a resume, naming what to set."""
    from raytrain_cpu.checkpoint import layout as ck_layout
    from raytrain_cpu.checkpoint import record as ck_record
    from raytrain_cpu.compat import ray as ray_compat
    from raytrain_cpu.launch.validate import check_ranking

    def scored(cfg, results: dict[str, str | None]) -> None:  # {checkpoint: its metric, or None: no score}
        run_dir = cfg.run.run_dir
        for name, metric in results.items():
            (run_dir / name).mkdir(parents=True, exist_ok=True)
            manifest = {"eval_watch": {"metric": metric}} if metric else {}
            (run_dir / name / ck_layout.MANIFEST).write_text(json.dumps(manifest))
        entries = [
            {"checkpoint_dir_name": n, "metrics": {"step": 1} | ({"checkpoint_score": 4.0} if m else {})}
            for n, m in results.items()
        ]
        (run_dir / ray_compat.SNAPSHOT).write_text(json.dumps({"checkpoint_results": entries}))

    mix = ["data.mix=[{source: bundled, weight: 1, name: wiki}]", "train.eval_every=10", "train.checkpoint_every=10"]
    cfg = make_config("run.best_metric=eval_loss", *mix)
    scored(cfg, {"checkpoint_000001": "eval_loss", "checkpoint_000002": "eval_loss"})
    check_ranking(cfg)  # the run's own metric: ranked as before
    check_ranking(make_config(*mix))  # no ranking: the newest are kept, scores unread
    with pytest.raises(
        ConfigError,
        match=r"checkpoints checkpoint_000001, checkpoint_000002 were scored by eval_loss, "
        r"not by eval_loss/wiki.*could delete the best. Set run.best_metric=eval_loss \(theirs\)",
    ):
        check_ranking(make_config("run.best_metric=eval_loss/wiki", *mix))
    # Saved at a step without an evaluation, before 2026-11-30: scored inf, which Ray's record
    # writes as null, and Ray Train's ranking failed on at every retry. Ranked last now.
    record = json.loads((cfg.run.run_dir / ray_compat.SNAPSHOT).read_text())
    record["checkpoint_results"][1]["metrics"]["checkpoint_score"] = None
    record["latest_checkpoint_result"] = record["checkpoint_results"][1]
    (cfg.run.run_dir / ray_compat.SNAPSHOT).write_text(json.dumps(record))
    check_ranking(cfg)
    record = json.loads((cfg.run.run_dir / ray_compat.SNAPSHOT).read_text())
    assert [r["metrics"]["checkpoint_score"] for r in record["checkpoint_results"]] == [4.0, ck_record.UNSCORED]
    assert record["latest_checkpoint_result"]["metrics"]["checkpoint_score"] == ck_record.UNSCORED
    assert "checkpoint_000002: saved at a step without an evaluation" in capsys.readouterr().out
    scored(cfg, {"checkpoint_000001": None, "checkpoint_000002": "eval_loss"})  # from before scores
    with pytest.raises(
        ConfigError, match=r"checkpoints checkpoint_000001 were saved without a score.*Leave run.best_metric out"
    ):
        check_ranking(cfg)


def test_rerunning_a_finished_run_prints_its_summary_and_changes_nothing(make_config, capsys):
    """The same command again (or a resubmitted job) once the run reached train.max_steps, or a
    lower train.max_steps: exit 0 with the run's summary, no Ray, config.yaml and summary.json
    untouched (it used to start Ray, train no step, overwrite summary.json with empty figures
    and fail printing them)."""
    from helpers import fast_overrides

    from raytrain_cpu.launch.driver import main

    cfg = make_config("run.name=r", "train.max_steps=2")
    run_dir = fake_run_dir(cfg, step=2)
    figures = {"steps": 2, "tokens_seen": 2048, "final_loss": 6.5, "eval_perplexity": 600.0, "tokens_per_s": 99.0}
    summary = {**figures, "world_size": 2, "wall_s": 30.0, "run_dir": str(run_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    before = {f: (run_dir / f).read_bytes() for f in ("config.yaml", "summary.json")}
    argv = fast_overrides(cfg.run.storage_path, cfg.data.cache_dir, "run.name=r")
    for steps in (2, 1):
        assert main([*argv, f"train.max_steps={steps}"]) == 0
        out = capsys.readouterr().out
        assert f"run 'r' is already at step 2 ({run_dir / 'checkpoint_000002'}), train.max_steps={steps}" in out
        assert "final loss       6.5000" in out and "eval perplexity  600.00" in out
        assert "workers x" not in out  # the line run_on_ray prints once it has Ray
    assert {f: (run_dir / f).read_bytes() for f in before} == before
    (run_dir / "summary.json").unlink()  # stopped after its last checkpoint, before the summary
    assert main([*argv, "train.max_steps=2"]) == 0
    assert "final loss       n/a" in capsys.readouterr().out
    assert not (run_dir / "summary.json").exists()


@pytest.fixture(scope="module")
def stub_hub():
    """The stub hub's URL for this module's tests (helpers.stub_hub_server)."""
    with stub_hub_server() as url:
        yield url


def test_a_hub_dataset_updated_under_the_same_file_names_is_new_data_to_the_cache_key(
    make_config, stub_hub, monkeypatch
):
    """A hub source was keyed by its files' names alone, so a dataset updated on the hub trained
    on the old cache, silently. Each file's blob id (its listing's) now keys it."""
    import huggingface_hub
    from huggingface_hub import HfFileSystem

    from raytrain_cpu.data.prepare import cache_key
    from raytrain_cpu.data.sources import DataError, source_specs
    from raytrain_cpu.model.tokenizer import resolve_tokenizer_path

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stub_hub)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setitem(HUB_FILES, "default/train/0001.parquet", HUB_FILES["default/train/0001.parquet"])

    def key() -> str:
        HfFileSystem.clear_instance_cache()  # a new process lists the hub afresh
        c = make_config(
            "data.source=hub", f"data.hub_id={PUBLIC_DATASET}", "data.hub_config=default", "data.eval_split="
        )
        train, evals = source_specs(c.data)
        assert train.paths == tuple(f"hf://datasets/{PUBLIC_DATASET}/{f}" for f in HUB_FILES)
        return cache_key(c, train, evals, resolve_tokenizer_path(c.model.tokenizer, c.model.name_or_path))

    before = key()
    assert key() == before
    HUB_FILES["default/train/0001.parquet"] = "e" * 40  # a new commit of the same file
    assert key() != before
    with pytest.raises(DataError, match=r"no parquet files for owner/wiki / wikitext-2-raw-v1 / split 'train'"):
        source_specs(make_config("data.source=hub", f"data.hub_id={PUBLIC_DATASET}").data)  # the default config


def test_a_run_without_evaluation_says_why():
    """Too little held-out text for one eval block per worker (a corpus of 24 documents holds
    out none at every 50th): the console says so and how to get one, rather than a summary
    with eval perplexity n/a and no word why (cache meta.json as prepare writes it)."""
    from raytrain_cpu.launch.datasets import no_evaluation

    held_out = {"eval_source": "held out: every 50th document", "documents": 24, "eval_blocks": 0, "seq_len": 256}
    assert no_evaluation(held_out, 2) == (
        "no evaluation: the eval data makes 0 blocks of 256 tokens, fewer than one per worker (2). "
        "Held out: every 50th document of 24; raise data.eval_fraction or set data.eval_path."
    )
    given = {"eval_source": {"kind": "text", "paths": ["/d/eval.txt"]}, "eval_blocks": 1, "seq_len": 2048}
    assert no_evaluation(given, 4).endswith(
        "fewer than one per worker (4). Give more evaluation text or lower data.seq_len."
    )


def test_a_second_job_on_a_running_run_directory_stops(tmp_path):
    """The same run.name and storage submitted again while the first job runs: a ConfigError
    naming the job that holds it (a real flock), not two jobs writing the same checkpoints. Free
    again once the first ends; a run directory made for a job that wrote nothing goes again."""
    from raytrain_cpu.launch.driver import RUN_LOCK, hold_run_dir

    run_dir = tmp_path / "runs" / "r"
    with hold_run_dir(run_dir):
        (run_dir / "config.yaml").write_text("x")
        busy = rf"^run.name: run 'r' is running already \(pid {os.getpid()} on "
        with pytest.raises(ConfigError, match=busy), hold_run_dir(run_dir):
            pass
    with hold_run_dir(run_dir):  # released when the first job ended
        pass
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(["config.yaml", RUN_LOCK])
    with pytest.raises(RuntimeError), hold_run_dir(tmp_path / "new" / "r"):
        raise RuntimeError("stopped before writing anything")
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------- seq_len vs the model's context


def model_dir(tmp_path: Path, **config) -> Path:
    d = tmp_path / config["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"")  # the check reads config.json only
    return d


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"model_type": "qwen2", "max_position_embeddings": 1024}, "max_position_embeddings"),
        ({"model_type": "gpt2", "n_positions": 1024, "n_embd": 64}, "n_positions"),
    ],
)
def test_seq_len_above_the_models_context(tmp_path, make_config, config, key):
    from raytrain_cpu.launch.validate import validate_before_ray

    d = model_dir(tmp_path, **config)
    validate_before_ray(make_config(f"model.name_or_path={d}", "data.seq_len=1024"))
    with pytest.raises(ConfigError) as e:
        validate_before_ray(make_config(f"model.name_or_path={d}", "data.seq_len=2048"))
    assert str(e.value) == (
        f"data.seq_len: 2048 exceeds the model's context: {d}/config.json has {key}=1024. "
        "Set data.seq_len=1024 or lower, or train a model with a longer context."
    )


def test_a_tokenizer_must_fit_the_models_embedding(tmp_path, make_config):
    """A model other than the tiny one trains with its own tokenizer unless told otherwise; a
    tokenizer whose ids outgrow the embedding (a worker's IndexError on its first batch) and a
    model without tokenizer files stop before Ray, naming the setting."""
    import shutil

    from raytrain_cpu.launch.validate import check_tokenizer_fits
    from raytrain_cpu.model.tokenizer import BUNDLED_TOKENIZER

    d = model_dir(tmp_path, model_type="llama", vocab_size=100)
    assert make_config(f"model.name_or_path={d}").model.tokenizer == ""  # 'auto': the model's own
    assert make_config().model.tokenizer == "bundled"  # ... and the bundled one for the tiny model
    with pytest.raises(ConfigError, match=r"^model.tokenizer: .*/llama holds no tokenizer \(tokenizer.json"):
        check_tokenizer_fits(make_config(f"model.name_or_path={d}"), str(d))
    with pytest.raises(ConfigError) as e:
        check_tokenizer_fits(make_config(f"model.name_or_path={d}", "model.tokenizer=bundled"), str(d))
    assert str(e.value) == (
        f"model.tokenizer: 'bundled' gives token ids up to 2047, but the model's embedding has 100 rows (vocab_size "
        f"in {d}/config.json). Train with the model's own tokenizer (model.tokenizer=''), or a model made for this "
        "tokenizer."
    )
    for f in BUNDLED_TOKENIZER.iterdir():  # the model's own tokenizer, as an export carries it
        shutil.copy(f, d)
    with pytest.raises(ConfigError, match="tokenizer files and config.json disagree"):
        check_tokenizer_fits(make_config(f"model.name_or_path={d}"), str(d))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 2048}))
    check_tokenizer_fits(make_config(f"model.name_or_path={d}"), str(d))
    with pytest.raises(ConfigError, match=r"^model.tokenizer: .* holds no tokenizer"):  # the tiny model's too
        check_tokenizer_fits(make_config(f"model.tokenizer={tmp_path}"), "tiny")
    check_tokenizer_fits(make_config(), "tiny")


def test_a_model_type_without_a_causal_lm_class(tmp_path, make_config):
    from raytrain_cpu.launch.validate import validate_before_ray

    d = model_dir(tmp_path, model_type="t5", architectures=["T5ForConditionalGeneration"], n_positions=512)
    with pytest.raises(ConfigError, match=r"^model.name_or_path: .* holds a 't5' model \(T5ForConditionalGeneration\)"):
        validate_before_ray(make_config(f"model.name_or_path={d}"))


def test_settings_recorded_in_the_manifest_win_over_config_yaml(make_config):
    """A manifest that records its hashed settings names the changes even when config.yaml was replaced."""
    from raytrain_cpu.checkpoint import identity as ck_identity
    from raytrain_cpu.checkpoint import layout as ck_layout
    from raytrain_cpu.launch.validate import validate_before_ray

    old = make_config("run.name=r")
    run_dir = fake_run_dir(old)
    manifest_path = run_dir / "checkpoint_000002" / ck_layout.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "settings": ck_identity.hashed_settings(old.to_dict())}))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(make_config("run.name=r", "train.seed=9").to_dict()))
    with pytest.raises(ConfigError, match=r"data.seq_len: 64 → 32\. "):
        validate_before_ray(make_config("run.name=r", "data.seq_len=32"))


def test_how_a_step_runs_may_change_on_a_resume_and_fields_added_since_do_not_block_it(make_config):
    """Activation checkpointing (to fit), compilation, the attention kernel and the data
    pipeline's parallelism may change between runs; so may the config grow a field: a
    checkpoint made before model.attention existed resumes. What the step computes may not."""
    from raytrain_cpu.checkpoint import identity as ck_identity
    from raytrain_cpu.checkpoint import layout as ck_layout
    from raytrain_cpu.launch.validate import validate_before_ray

    old = make_config("run.name=r")
    run_dir = fake_run_dir(old)
    validate_before_ray(
        make_config(
            "run.name=r",
            "model.activation_checkpointing=true",
            "model.compile=true",
            "model.attention=sdpa",
            "data.tokenize_actors=2",
            "data.prefetch_batches=1",
        )
    )
    # As an older version wrote it: no model.attention in the settings or their hash.
    settings = ck_identity.hashed_settings(old.to_dict())
    del settings["model"]["attention"]
    manifest_path = run_dir / "checkpoint_000002" / ck_layout.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(
        json.dumps({**manifest, "settings": settings, "config_hash": ck_identity.config_hash(settings)})
    )
    validate_before_ray(make_config("run.name=r"))
    with pytest.raises(ConfigError, match=r"model.tiny.hidden_size: 64 → 96\."):
        validate_before_ray(make_config("run.name=r", "model.tiny.hidden_size=96"))


def test_a_resume_keeps_the_zero_stage_and_sub_groups_its_shards_were_laid_out_by(make_config):
    """The ZeRO stage and (at ZeRO-3) the sub-group size shape the optimizer shards: a resume that
    changes them stops before Ray, naming the old values; a manifest that predates a key skips it."""
    from raytrain_cpu.checkpoint import layout as ck_layout
    from raytrain_cpu.launch.validate import validate_before_ray

    run_dir = fake_run_dir(make_config("run.name=r"))
    manifest_path = run_dir / "checkpoint_000002" / ck_layout.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    validate_before_ray(make_config("run.name=r", "deepspeed.sub_group_size=1e9"))  # no record: not checked
    manifest_path.write_text(json.dumps({**manifest, "zero_stage": 3, "sub_group_size": 100_000_000}))
    validate_before_ray(make_config("run.name=r"))
    with pytest.raises(ConfigError, match=r"deepspeed.sub_group_size: 100000000 → 1000000000\. Resume with "
                                          r"deepspeed.sub_group_size=100000000, or export"):  # fmt: skip
        validate_before_ray(make_config("run.name=r", "deepspeed.sub_group_size=1e9"))
    with pytest.raises(ConfigError, match=r"deepspeed.zero_stage: 3 → 2\. Resume with deepspeed.zero_stage=3,"):
        validate_before_ray(make_config("run.name=r", "deepspeed.zero_stage=2", "deepspeed.sub_group_size=1e9"))


def test_local_ray_offers_the_mask_but_at_least_two_cpus(one_vcpu):
    """Under a 1-vCPU mask a local Ray offers 2 CPUs: the two default workers share the one."""
    from raytrain_cpu.host.threads import affinity_cpus
    from raytrain_cpu.launch.sizing import local_ray_cpus

    assert affinity_cpus() == 1 and local_ray_cpus() == 2


def test_a_run_that_cannot_fit_a_node_stops_before_it_loads(tmp_path, make_config, capsys):
    """Llama-3-8B's shape at world size 4 with the planner's peak per rank against a node's
    memory: it stops above the node's memory (Ray's monitor would kill each restart after its
    load), warns above what the planner leaves a node, and says nothing when it fits."""
    from raytrain_cpu.launch.sizing import check_memory
    from raytrain_cpu.planner import plan
    from raytrain_cpu.planner import tables as plan_tables

    s = plan_tables.resolve_shape("meta-llama/Meta-Llama-3-8B")
    d = model_dir(tmp_path, model_type="llama", **s.llama_config())
    cfg = make_config(f"model.name_or_path={d}", "model.tokenizer=bundled", "data.seq_len=1024")

    def node(gib: float, workers: int = 4, per_node: int = 1) -> dict:
        return {"num_workers": workers, "workers_per_node": per_node, "node_cpu": {"memory_bytes": int(gib * 2**30)}}

    peak = plan.plan(**plan.inputs_from_config(cfg, str(d), 4))["memory_gib"]["peak"]
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, str(d), node(peak * 0.9))
    assert str(e.value).startswith(f"scaling: the planner estimates a training peak of {peak:.1f} GiB per rank, more")
    assert "model.activation_checkpointing=true" in str(e.value) and "scaling.check_memory=false" in str(e.value)
    with pytest.raises(ConfigError, match=r"per rank x 2 ranks a node = "):
        check_memory(cfg, str(d), node(peak * 1.5, per_node=2))
    capsys.readouterr()
    check_memory(cfg, str(d), node(peak * 1.05))
    assert "[raytrain] memory is tight" in capsys.readouterr().out
    check_memory(cfg, str(d), node(384))  # a c7i.48xlarge
    check_memory(cfg, str(d), node(0))  # memory unknown: no check
    assert capsys.readouterr().out == ""


def test_node_memory_is_the_smaller_of_memtotal_and_the_cgroup_limit(tmp_path):
    from raytrain_cpu.host.features import memory_bytes

    (tmp_path / "meminfo").write_text("MemTotal:       65536000 kB\nMemFree:        1000 kB\n")
    (tmp_path / "cg").mkdir()
    assert memory_bytes(str(tmp_path / "meminfo"), str(tmp_path / "cg")) == 65536000 * 1024
    (tmp_path / "cg" / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    assert memory_bytes(str(tmp_path / "meminfo"), str(tmp_path / "cg")) == 65536000 * 1024
    (tmp_path / "cg" / "memory.max").write_text(f"{24 * 2**30}\n")  # a pod's limit
    assert memory_bytes(str(tmp_path / "meminfo"), str(tmp_path / "cg")) == 24 * 2**30
    assert memory_bytes(str(tmp_path / "none"), str(tmp_path / "none")) == 0


def test_auto_workers_resume_with_the_checkpoints_count(make_config):
    """scaling.num_workers=0 follows the cluster's nodes, which may differ by the time a run
    resumes (an autoscaler still starting them, a lost node): a resume takes the checkpoint's
    worker count instead, as its shards need; an explicit count stays and is checked."""
    from raytrain_cpu.launch.resume import resume_world

    cfg = make_config("run.name=r")
    assert resume_world(cfg) is cfg  # no checkpoint yet
    fake_run_dir(cfg, world=3)
    assert resume_world(cfg).scaling.num_workers == 3
    assert resume_world(make_config("run.name=r", "scaling.num_workers=2")).scaling.num_workers == 2


def test_storage_without_room_for_a_checkpoint_stops_before_training(make_config, monkeypatch, capsys):
    """A checkpoint holds 12 bytes a parameter (fp32 master weights, Adam's moments): storage that
    can't hold one stops the run before it trains; room for fewer than run.num_to_keep + 1 warns."""
    import collections
    import shutil

    from raytrain_cpu.launch.validate import check_checkpoint_room

    cfg = make_config("run.name=r")
    cfg.run.run_dir.mkdir(parents=True)
    n = 12 * 354_624  # the tiny model's checkpoint, counted from its shape
    usage = collections.namedtuple("usage", "total used free")
    for free, stops, warns in [(n - 1, True, False), (2 * n, False, True), (3 * n, False, False)]:
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(10 * n, 0, free))
        if stops:
            with pytest.raises(ConfigError, match=r"^run.storage_path: .* free, and a checkpoint of this model takes"):
                check_checkpoint_room(cfg, "tiny")
        else:
            check_checkpoint_room(cfg, "tiny")
        assert ("[raytrain] storage:" in capsys.readouterr().out) == warns
    # What a save that filled the storage left staged is room: the next save removes it first.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * n, 0, 1))
    staged = cfg.run.run_dir / ".staging" / "checkpoint_000015" / "ds"
    staged.mkdir(parents=True)
    with open(staged / "shard.pt", "wb") as f:
        f.truncate(n)  # sparse: its size, without the bytes
    check_checkpoint_room(cfg, "tiny")
    check_checkpoint_room(make_config("run.name=r", "lora.rank=4"), "tiny")  # adapters only: not checked


def test_mlflow_asked_for_but_not_installed(make_config, monkeypatch):
    """metrics.mlflow_tracking_uri without mlflow stops before Ray (rank 0 warned and trained on)."""
    import importlib.util

    from raytrain_cpu.launch.validate import validate_before_ray

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^metrics.mlflow_tracking_uri: set, but mlflow is not installed"):
        validate_before_ray(make_config("metrics.mlflow_tracking_uri=http://mlflow:5000"))


def test_an_allocator_asked_for_but_not_installed(make_config, monkeypatch):
    """An explicit scaling.allocator the machine lacks stops before Ray (the workers ran on glibc's
    malloc, and only their start-up line said so); auto falls back as it always has."""
    from raytrain_cpu.host import memory as host_memory
    from raytrain_cpu.launch.validate import validate_before_ray

    monkeypatch.setattr(host_memory, "find_allocator", lambda choice="auto", search_dirs=(): ("system", ""))
    with pytest.raises(ConfigError, match=r"^scaling.allocator: tcmalloc is not installed here"):
        validate_before_ray(make_config("scaling.allocator=tcmalloc"))
    validate_before_ray(make_config("scaling.allocator=auto"))


def test_compile_asked_for_without_a_cpp_compiler(make_config, monkeypatch):
    """model.compile=true where inductor finds no C++ compiler stops before Ray (inductor failed
    in the first step on every worker, with a page of its own traceback)."""
    from raytrain_cpu.launch.validate import validate_before_ray

    monkeypatch.setenv("CXX", "no-such-compiler++")
    with pytest.raises(ConfigError, match=r"^model.compile: true, .* no C\+\+ compiler \(no-such-compiler\+\+ is not"):
        validate_before_ray(make_config("model.compile=true"))
    validate_before_ray(make_config("model.compile=auto"))
