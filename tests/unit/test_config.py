"""Config parsing, overrides and every validation error, all before Ray starts.
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_config_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_cpu.config.checks import ConfigError
from raytrain_cpu.config.data import MixSource, mix_counts
from raytrain_cpu.config.schema import Config, load_config
from raytrain_cpu.data.sources import DataError, check_sources
from raytrain_cpu.launch.validate import check_storage, validate_before_ray
from raytrain_cpu.planner import plan

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_equal_local_yaml():
    assert load_config(ROOT / "configs/local.yaml") == Config()


def test_cluster_config_loads():
    cfg = load_config(ROOT / "configs/llama3-8b-c7i.yaml")
    assert cfg.model.name_or_path == "meta-llama/Meta-Llama-3-8B"
    assert cfg.data.source == "hub" and cfg.data.hub_config == "wikitext-2-raw-v1"
    assert cfg.run.storage_path.startswith("/fsx")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    """What the README, docs/ and the configs' own comments tell users to run: the keys are known and
    every check the config makes of itself passes."""
    load_config(path)


def test_overrides_are_typed():
    cfg = load_config(
        ROOT / "configs/local.yaml",
        [
            "train.max_steps=20",
            "scaling.num_workers=1",
            "train.lr=1e-3",
            "train.betas=[0.8, 0.9]",
            "model.activation_checkpointing=true",
            "deepspeed.sub_group_size=1e9",  # YAML 1.1 reads this as a string; an integer field takes it
            "lora.target_modules=q_proj, v_proj",  # a list of names, comma-separated as shells pass it
        ],
    )
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.train.max_steps == 20 and cfg.scaling.num_workers == 1
    assert cfg.deepspeed.sub_group_size == 10**9 and isinstance(cfg.deepspeed.sub_group_size, int)
    assert cfg.train.lr == pytest.approx(1e-3) and cfg.train.betas == [0.8, 0.9]
    assert cfg.model.activation_checkpointing is True


def test_local_paths_are_recorded_absolute(tmp_path, monkeypatch):
    """Relative to the directory the run starts in, and kept when a worker rebuilds the config
    elsewhere; hub ids, 'tiny' and 'bundled' stay names."""
    from raytrain_cpu.trainer.engine import deepspeed_config

    for d in ("model", "tok"):
        (tmp_path / d).mkdir()
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (tmp_path / "ds.json").write_text('{"wall_clock_breakdown": true}')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        None,
        ["model.name_or_path=model", "model.tokenizer=./tok", "model.compile_cache_dir=cache"]
        + ["data.format=chat", "data.chat_template=t.jinja", "deepspeed.config_file=ds.json"]
        + ["metrics.mlflow_tracking_uri=mlruns"],
    )
    assert cfg.model.name_or_path == str(tmp_path / "model") and cfg.model.tokenizer == str(tmp_path / "tok")
    assert cfg.model.compile_cache_dir == str(tmp_path / "cache")
    assert cfg.deepspeed.config_file == str(tmp_path / "ds.json")
    assert cfg.metrics.mlflow_tracking_uri == str(tmp_path / "mlruns")
    uri = "http://mlflow:5000"
    assert load_config(None, [f"metrics.mlflow_tracking_uri={uri}"]).metrics.mlflow_tracking_uri == uri
    assert cfg.data.chat_template == str(tmp_path / "t.jinja")
    monkeypatch.chdir(ROOT)
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert deepspeed_config(Config.from_dict(cfg.to_dict()), 2)["wall_clock_breakdown"] is True  # read elsewhere
    hub = load_config(None, ["model.name_or_path=meta-llama/Meta-Llama-3-8B", "model.tokenizer=org/tok"])
    assert (hub.model.name_or_path, hub.model.tokenizer) == ("meta-llama/Meta-Llama-3-8B", "org/tok")
    assert (Config().model.name_or_path, Config().model.tokenizer) == ("tiny", "bundled")


def test_the_run_length_is_steps_or_epochs_and_the_command_line_chooses(tmp_path):
    """train.epochs replaces train.max_steps; one place setting both is a mistake to name, and the
    command line's choice replaces the file's (configs/local.yaml spells max_steps out)."""
    local = ROOT / "configs/local.yaml"
    cfg = load_config(local, ["train.epochs=2"])
    assert cfg.train.epochs == 2 and load_config(local, ["train.epochs=0"]).train.epochs == 0
    both = tmp_path / "both.yaml"
    both.write_text("train:\n  max_steps: 5\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"^train.max_steps and train.epochs: --config .*both.yaml sets both"):
        load_config(both)
    assert (
        load_config(both, ["train.max_steps=7"]).train.max_steps,
        load_config(both, ["train.max_steps=7"]).train.epochs,
    ) == (7, 0)
    assert load_config(both, ["train.epochs=1"]).train.epochs == 1
    with pytest.raises(ConfigError, match=r"^train.max_steps and train.epochs: the command line sets both; keep one"):
        load_config(local, ["train.epochs=2", "train.max_steps=5"])
    assert (
        load_config(None, ["train.epochs=1", "train.profile_step=300"]).train.profile_step == 300
    )  # checked once packed


@pytest.mark.parametrize(
    ("epochs", "blocks", "batch", "steps"),
    [(1, 80, 8, 10), (1, 81, 8, 11), (2, 600, 400, 3), (0.5, 80, 8, 5), (0.01, 80, 8, 1), (3, 7, 8, 3)],
)
def test_epochs_become_steps_that_train_every_block(epochs, blocks, batch, steps):
    """ceil: each pass trains every block at least once; 2 x 600 / 400 is 3, not 4 (floating point)."""
    assert load_config(None, [f"train.epochs={epochs}"]).train.epoch_steps(blocks, batch) == steps


def test_epochs_set_the_steps_once_the_data_are_packed(capsys):
    from raytrain_cpu.launch.datasets import steps_of_epochs

    cfg = load_config(None, ["train.epochs=2.5"])
    resolved = steps_of_epochs(cfg, {"blocks": 1000}, 16)
    assert resolved.train.max_steps == 157 and resolved.train.epochs == 2.5 and resolved.model == cfg.model
    assert "[raytrain] train.epochs=2.5: 1,000 training blocks, 16 a step: 157 steps" in capsys.readouterr().out
    plain = load_config(None, ["train.max_steps=9"])
    assert steps_of_epochs(plain, {"blocks": 1000}, 16) is plain
    late = load_config(None, ["train.epochs=1", "train.profile_step=70"])
    with pytest.raises(ConfigError, match=r"^train.profile_step: 70 is past the 63 steps of train.epochs=1; pick"):
        steps_of_epochs(late, {"blocks": 1000}, 16)


def test_round_trip_through_plain_dict():
    cfg = load_config(None, ["train.max_steps=7", "scaling.resources_per_worker={c7i_48xl: 1}"])
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("overrides", "key", "hint"),
    [
        (["train.max_stepz=3"], "train.max_stepz", "did you mean train.max_steps? valid keys"),
        (["bogus.x=1"], "bogus", "valid keys"),
        (["train.max_steps=abc"], "train.max_steps", "integer"),
        (["train.lr=fast"], "train.lr", "number"),
        (["model.activation_checkpointing=maybe"], "model.activation_checkpointing", "true or false"),
        (["train.max_steps=0"], "train.max_steps", "positive"),
        (["train.lr=-1"], "train.lr", "> 0"),
        (["train.epochs=-1"], "train.epochs", ">= 0, e.g. 3"),
        (["train.epochs=.inf"], "train.epochs", ">= 0, e.g. 3"),
        (["train.schedule=linear"], "train.schedule", "cosine"),
        (["model.dtype=fp16"], "model.dtype", "bf16"),
        (["model.tiny.num_heads=3"], "model.tiny.num_heads", "divide"),
        (["data.seq_len=4096"], "data.seq_len", "max_position_embeddings"),
        (["data.source=parquet"], "data.path", "data.path="),
        (["data.bad_rows=ignore"], "data.bad_rows", "skip"),
        (["data.attention_span=sequence"], "data.attention_span", "document, block"),
        (["train.global_batch_size=12"], "train.global_batch_size", "multiple"),
        (["deepspeed.zero_stage=4"], "deepspeed.zero_stage", "1, 2, 3"),
        (["train.profile_step=300"], "train.profile_step", "1..max_steps"),
        (["train.mfu_probe_every=-1"], "train.mfu_probe_every", ">= 0"),
        (["model.compile_scope=graph"], "model.compile_scope", "layers"),
        (["model.compile=1"], "model.compile", "true, false or auto"),
        (["model.compile=fast"], "model.compile", "true, false or auto"),
        (["model.weight_grad_kernel=always"], "model.weight_grad_kernel", "true, false or auto"),
        (["deepspeed.config_file=/nope.json"], "deepspeed.config_file", "does not exist"),
        (["run.name=a/b"], "run.name", "plain directory"),
        (["run.storage_path=s3://bucket/runs"], "run.storage_path", "is a URL"),
        (["model.tokenizer="], "model.tokenizer", "the tiny model has none"),
        (["train.eps=0"], "train.eps", "> 0"),
        (["train.weight_decay=-0.1"], "train.weight_decay", ">= 0"),
        (["data.cache_dir=s3://bucket/cache"], "data.cache_dir", "/fsx"),
        (["train.betas=[0.9]"], "train.betas", "two numbers"),
        (["train.betas=0.9"], "train.betas", "[0.9, 0.95]"),
        (["lora.target_modules={a: 1}"], "lora.target_modules", "[q_proj, v_proj]"),
        (["scaling.min_workers=1"], "scaling.min_workers", "needs scaling.num_workers"),
        (["scaling.num_workers=2", "scaling.min_workers=3"], "scaling.min_workers", "above scaling.num_workers=2"),
        (["scaling.resize_check_s=0"], "scaling.resize_check_s", "> 0"),
        (["data.mix=[{path: /no/such/dir, weight: 1}]"], "data.mix[0].path", "does not exist"),
        (["data.mix=[{source: bundled}]"], "data.mix[0].weight", "is missing; give each source a weight"),
        (["data.mix=[{source: bundled, weight: -1.5}]"], "data.mix[0].weight", "0 only evaluates it"),
        (["data.mix=[{source: bundled, weight: -1}]"], "data.mix[0].weight", "got -1.0; give each source"),
        (
            ["data.mix=[{source: bundled, weight: .inf}, {source: bundled, name: b, weight: 1}]"],
            "data.mix[0].weight",
            "got inf; give each source a weight, a number >= 0",
        ),  # a traceback in mix_counts
        (["data.mix=[{source: bundled, weight: 0}]"], "data.mix", "every source has weight 0"),
        (["data.mix=[{source: bundled, weight: 1, colour: red}]"], "data.mix[0].colour", "valid keys are weight"),
        (["data.mix=[bundled]"], "data.mix[0]", "section"),
        (["data.mix=[{weight: 1}, {weight: 2}]"], "data.mix[1].name", "give each source its own name"),
        (["data.mix=[{weight: 1, name: my data}]"], "data.mix[0].name", "letters, digits"),
        (["data.mix=[{weight: 1}, {source: hub, weight: 1e-4}]"], "data.mix[1].weight", "under 1/1000"),
        (["data.path=a.txt", "data.mix=[{weight: 1}]"], "data.path", "move it into a data.mix entry"),
        (["data.source=mix"], "data.source", "needs data.mix entries"),
        (
            ["data.mix=[{source: text, path: a.txt, format: chat, weight: 1}]"],
            "data.mix[0].format",
            "data.mix[0].source",
        ),
        (["data.mix=[{source: hub, path: x.txt, weight: 1}]"], "data.mix[0].path", "data.mix[0].source=hub reads"),
        (["run.best_metric=loss"], "run.best_metric", "choose one of eval_loss"),
        (["data.mix=[{weight: 1, name: wiki}]", "run.best_metric=eval_loss/web"], "run.best_metric", "eval_loss/wiki"),
        (["run.best_metric=eval_loss", "train.eval_every=0"], "run.best_metric", "set train.eval_every"),
        (["train.early_stop_patience=3", "train.eval_every=0"], "train.early_stop_patience", "train.eval_every"),
        (["run.best_metric=eval_loss", "train.eval_every=30"], "run.best_metric", "train.checkpoint_every=90"),
        (["train.early_stop_patience=-1"], "train.early_stop_patience", ">= 0"),
        (["train.early_stop_min_delta=-0.1"], "train.early_stop_min_delta", ">= 0"),
        (["train.sample_prompt=Hello", "train.sample_tokens=256"], "train.sample_tokens", "no room for the prompt"),
        (["train.sample_tokens=0"], "train.sample_tokens", "positive"),
        (["train"], "train", "section.key=value"),
        (["train=3"], "train", "section"),
    ],
)
def test_validation_names_key_and_fix(overrides, key, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(key) or key in str(e.value)
    assert hint in str(e.value)


def test_an_elastic_range_must_split_the_global_batch():
    """Every worker count of scaling.min_workers..num_workers takes whole micro batches of the one
    global batch; fewer workers accumulate more. Otherwise the error names what fixes it."""
    cfg = load_config(
        None, ["scaling.num_workers=4", "scaling.min_workers=2", "train.micro_batch_size=2", "train.grad_accum_steps=3"]
    )
    assert cfg.elastic and list(cfg.worker_counts) == [2, 3, 4]
    assert [cfg.accumulation_for(w) for w in cfg.worker_counts] == [6, 4, 3]  # 24 blocks each time
    assert plan.inputs_from_config(cfg)["world_size"] == 2  # the fewest workers hold the largest shards
    with pytest.raises(ConfigError) as e:
        load_config(None, ["scaling.num_workers=4", "scaling.min_workers=2", "train.micro_batch_size=6"])
    assert str(e.value).startswith(
        "scaling.min_workers: the global batch of 24 blocks (4 workers x micro_batch_size 6 x grad_accum_steps 1) "
        "does not split into micro batches of 6 over 3 workers, which the elastic range 2..4 allows. Use "
        "train.grad_accum_steps=3 (a global batch of 72) or train.micro_batch_size=2 with train.grad_accum_steps=3."
    ), e.value
    with pytest.raises(
        ConfigError, match=r"over 3 or 4 workers.*Use train.grad_accum_steps=12 \(a global batch of 240\)\.$"
    ):
        load_config(None, ["scaling.num_workers=5", "scaling.min_workers=3", "train.micro_batch_size=4"])
    assert not load_config(None, ["scaling.num_workers=2", "scaling.min_workers=2"]).elastic  # one count


def test_a_mixture_resolves_each_source_and_shares_the_rest(tmp_path, monkeypatch):
    """data.mix: each entry is a source of its own (resolved and named as data: would be), the
    other data settings are every source's; whole weights are kept, others to 1/1000."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.jsonl").write_text('{"text": "x"}\n')
    cfg = load_config(
        None,
        [
            "data.seq_len=128",
            "data.mix=[{source: bundled, weight: 3}, {path: notes/, weight: 1}, {path: 'notes/*.jsonl', name: again, weight: 1}]",
        ],
    )
    assert cfg.data.source == "mix"
    assert [(e.name, e.source) for e in cfg.data.mix] == [
        ("bundled", "bundled"),
        ("notes", "jsonl"),
        ("again", "jsonl"),
    ]
    parts = cfg.data.parts()
    assert [(p.source, p.path, p.seq_len, p.mix) for p in parts] == [
        ("bundled", "", 128, []),
        ("jsonl", "notes/", 128, []),
        ("jsonl", "notes/*.jsonl", 128, []),
    ]
    assert Config.from_dict(cfg.to_dict()) == cfg  # plain dicts across the Ray boundary
    assert load_config(None, []).data.parts() == [load_config(None, []).data]  # one source: itself
    glob = load_config(None, ["data.mix=[{source: bundled, weight: 1}, {source: text, path: 'none/*.txt', weight: 1}]"])
    with pytest.raises(DataError, match=r"^data.mix\[1\].path: 'none/\*.txt' holds no .txt"):
        check_sources(glob.data)  # the files are listed before Ray starts, an entry's named as such
    assert MixSource(path="s3://bucket/corpus/web.jsonl.gz", source="jsonl").default_name("wikitext") == "web"
    assert MixSource(source="hub").default_name("allenai/c4") == "c4"
    # How to read a source comes from data: unless the entry says otherwise; never silently dropped.
    columns = load_config(
        None,
        [
            "data.text_column=body",
            "data.mix=[{path: notes/, weight: 1}, {path: notes/, name: other, text_column: content, weight: 1}]",
        ],
    )
    assert [p.text_column for p in columns.data.parts()] == ["body", "content"]
    assert [e.text_column for e in columns.data.mix] == ["", "content"]  # recorded as given
    assert [mix_counts(w) for w in ([3, 1], [1, 1, 1], [0.75, 0.25], [0.7, 0.3], [2, 3e-3], [0.7, 0, 0.3])] == [
        [3, 1],
        [1, 1, 1],
        [3, 1],
        [7, 3],
        [999, 1],
        [7, 0, 3],  # weight 0: evaluated, never drawn
    ]


def test_overrides_may_stand_on_both_sides_of_config():
    """`main run.storage_path=... --config c.yaml run.name=x` once failed: "unrecognized arguments"."""
    from raytrain_cpu.launch.driver import parse_args

    args = parse_args(["run.storage_path=/s", "--config", "configs/local.yaml", "run.name=x"])
    assert args.config == "configs/local.yaml" and args.overrides == ["run.storage_path=/s", "run.name=x"]


def test_missing_config_file():
    with pytest.raises(ConfigError, match="--config.*does not exist"):
        load_config("/no/such.yaml")


def test_batch_must_divide_world_size():
    cfg = load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=8"])
    assert cfg.train.derive_global_batch(2) == 8
    with pytest.raises(ConfigError, match=r"train.global_batch_size.*3 workers.*global_batch_size=12"):
        cfg.train.derive_global_batch(3)


def test_missing_model_path_fails_before_ray(tmp_path):
    cfg = load_config(None, [f"model.name_or_path={tmp_path}/nope", f"run.storage_path={tmp_path}/runs"])
    with pytest.raises(ConfigError, match="model.name_or_path.*does not exist"):
        validate_before_ray(cfg)
    (tmp_path / "empty").mkdir()
    cfg = load_config(None, [f"model.name_or_path={tmp_path}/empty", f"run.storage_path={tmp_path}/runs"])
    with pytest.raises(ConfigError, match="no config.json; it is not a Hugging Face model directory"):
        validate_before_ray(cfg)
    # What a user may point at instead of a model: an adapter export, a checkpoint, a run.
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    (tmp_path / "run" / "checkpoint_000010").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint_000010" / "manifest.json").write_text("{}")
    for model, why in [("adapter", "LoRA adapter.*--merge"), ("run", "raytrain checkpoint or run. Export it first")]:
        cfg = load_config(None, [f"model.name_or_path={tmp_path / model}", f"run.storage_path={tmp_path}/runs"])
        with pytest.raises(ConfigError, match=f"no config.json; it holds a {why}|no config.json; it is a {why}"):
            validate_before_ray(cfg)


def test_unwritable_storage_fails_and_writes_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="run.storage_path.*is a file"):
        check_storage(blocker / "runs" / "name")
    with pytest.raises(ConfigError, match="run.storage_path: cannot write"):
        check_storage(Path("/proc/raytrain_cpu_runs/name"))
    check_storage(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_storage_mount_that_is_not_there_is_named(tmp_path):
    """/fsx/runs where /fsx is not mounted (the cluster config on a laptop, a node without FSx):
    an error naming /fsx, not a run directory made on the root disk, where other nodes can't see it."""
    missing = Path("/raytrain_no_such_mount")
    cfg = load_config(None, [f"run.storage_path={missing}/runs", f"data.cache_dir={tmp_path}/cache"])
    with pytest.raises(ConfigError, match=rf"^run.storage_path: {missing} does not exist. On a cluster it is"):
        validate_before_ray(cfg)
    cfg = load_config(None, [f"run.storage_path={tmp_path}/runs", f"data.cache_dir={missing}/data_cache"])
    with pytest.raises(ConfigError, match=rf"^data.cache_dir: {missing} does not exist"):
        validate_before_ray(cfg)
    assert not missing.exists() and not any(tmp_path.iterdir())


def test_data_source_follows_data_path(tmp_path):
    """data.source=auto (the default): the bundled text without data.path, else what data.path's
    file names say; a data.path beside data.source=bundled is refused, not silently ignored."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl.gz").write_bytes(b"")
    (tmp_path / "t.txt").write_text("x")
    cases = {
        "": "bundled",
        str(tmp_path / "t.txt"): "text",
        str(tmp_path / "d"): "jsonl",
        "s3://b/*.parquet": "parquet",
    }
    for path, source in cases.items():
        assert load_config(None, [f"data.path={path}"] if path else []).data.source == source, path
    with pytest.raises(ConfigError, match="^data.path: is set, but data.source=bundled reads the bundled text"):
        load_config(None, [f"data.path={tmp_path / 't.txt'}", "data.source=bundled"])
    with pytest.raises(ConfigError, match="^data.eval_path: is set, but data.source=bundled reads the bundled"):
        load_config(None, [f"data.eval_path={tmp_path / 't.txt'}"])
    with pytest.raises(ConfigError, match="^data.path: is set, but data.source=hub reads data.hub_id's splits"):
        load_config(None, [f"data.path={tmp_path / 't.txt'}", "data.source=hub"])
    with pytest.raises(ConfigError, match="^data.path: '/no/such/corpus' does not exist"):
        load_config(None, ["data.path=/no/such/corpus"])
    # What auto cannot tell is named, with its fix: two kinds, no known suffix (a file, a
    # directory's files: read by suffix), nothing at all.
    (tmp_path / "d" / "b.txt").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {
        "d": "^data.source: cannot tell .* it holds jsonl and text files; set data.source to the kind to read",
        "notes/a.md": r"^data.source: cannot tell .*: its name ends in none of .txt, .* set data.source=text, jsonl",
        "notes": r"^data.source: .*: none of its files' names ends in .txt, .*: rename them \(notes.md -> notes.txt",
        "empty": "^data.path: '.*/empty' is an empty directory; point it at",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"data.path={tmp_path / path}"])


def test_attention_span_auto_keeps_chat_examples_apart_and_text_packed(tmp_path):
    """data.attention_span=auto is resolved when the config loads (checkpoints record what ran):
    'document' where any source holds chat or instruction examples, 'block' for text."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": []}\n')
    cases = {
        (): "block",
        ("data.format=chat",): "document",
        ("data.format=chat", "data.attention_span=block"): "block",
        ("data.attention_span=document",): "document",
        (f"data.mix=[{{source: bundled, weight: 3}}, {{path: {rows}, format: chat, weight: 1}}]",): "document",
        ("data.mix=[{source: bundled, weight: 1}]",): "block",
    }
    for overrides, span in cases.items():
        assert load_config(None, list(overrides)).data.attention_span == span, overrides


def test_a_deepspeed_file_may_not_contradict_the_config(tmp_path):
    """The file's raw keys merge over the generated config; one a raytrain key also sets must
    agree with it (else the run trains ZeRO-2 while the manifest and resume checks say 3)."""
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e8}}))
    with pytest.raises(ConfigError, match=r"sets zero_optimization.stage=2, and deepspeed.zero_stage=3 sets it too"):
        load_config(None, [f"deepspeed.config_file={f}"])
    assert load_config(None, [f"deepspeed.config_file={f}", "deepspeed.zero_stage=2"]).deepspeed.zero_stage == 2
    f.write_text(json.dumps({"gradient_clipping": "auto", "train_batch_size": "auto"}))  # HF-style files pass
    load_config(None, [f"deepspeed.config_file={f}"])
    load_config(None, [f"deepspeed.config_file={ROOT / 'configs/ds_zero3_cpu.json'}"])  # the shipped example
    f.write_text(json.dumps({"checkpoint": {"load_universal": True}}))  # set per resume (checkpoint.to_universal)
    with pytest.raises(ConfigError, match="sets checkpoint.load_universal: raytrain sets it"):
        load_config(None, [f"deepspeed.config_file={f}"])
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(None, [f"deepspeed.config_file={f}"])


def test_ray_train_gets_the_runs_timeouts_and_poll_interval(monkeypatch):
    """Settings Ray Train reads only from the driver's environment (it hands them to its controller)."""
    from raytrain_cpu.launch.driver import ray_train_env

    env = ray_train_env(load_config(None, ["run.gloo_timeout_s=120", "run.poll_interval_s=0.5"]))
    assert env == {
        "RAY_TRAIN_COLLECTIVE_TIMEOUT_S": "120",
        "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S": "120",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    }
    monkeypatch.delenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", raising=False)
    elastic = load_config(None, ["scaling.num_workers=2", "scaling.min_workers=1"])
    assert ray_train_env(elastic)["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "30"
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "15")  # one set by hand stays
    assert ray_train_env(elastic)["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "15"
    with pytest.raises(ConfigError, match=r"run.poll_interval_s"):
        load_config(None, ["run.poll_interval_s=0"])


def test_the_trainer_starts_no_dataset_manager_and_the_cleaner_only_when_asked():
    """Ray Train's helper actors, each a process: no dataset manager for a trainer given no
    datasets (the workers read their own blocks), the placement-group cleaner as configured."""
    import ray.train

    from raytrain_cpu.compat.ray_backend import GlooConfig, LeanTorchTrainer

    def callbacks(**kwargs) -> set[str]:
        trainer = LeanTorchTrainer(
            lambda: None, backend_config=GlooConfig(), scaling_config=ray.train.ScalingConfig(num_workers=2), **kwargs
        )
        return {type(c).__name__ for c in trainer._create_default_callbacks()}

    kept = callbacks()
    assert "DatasetsCallback" not in kept and {"BackendSetupCallback", "PlacementGroupCleanerCallback"} <= kept
    assert callbacks(placement_group_cleaner=False) == kept - {"PlacementGroupCleanerCallback"}
    assert "DatasetsCallback" in callbacks(datasets={"train": lambda: ray.data.range(4)})  # given data: as Ray does
    assert load_config(None, []).run.placement_group_cleaner  # Ray's default, kept
