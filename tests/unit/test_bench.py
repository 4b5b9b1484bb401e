"""The benchmark harness: result files, and a smoke run at tiny size (no Ray, well under a minute).
The tests of this module that need Ray, a subprocess or a process group: tests/integration/test_bench_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench import cli, common, kernels, reference, runs


def test_results_are_json_and_markdown(tmp_path):
    result = {
        "command": "python -m raytrain_cpu.bench gemm",
        "machine": "test box",
        "tables": {"GEMM peak": [{"dtype": "bfloat16", "GFLOP/s": 74.7}, {"dtype": "float32", "GFLOP/s": 120.0}]},
        "notes": ["measured side by side"],
    }
    path = common.write_results("gemm", result, str(tmp_path / "gemm.json"))
    assert json.loads(path.read_text())["machine"] == "test box"
    md = path.with_suffix(".md").read_text()
    assert "| dtype | GFLOP/s |" in md and "| float32 | 120.0 |" in md and "- measured side by side" in md


def test_compare_reports_ratios_to_the_baseline():
    rows = [
        {
            "variant": "a",
            "tokens_per_s": 100.0,
            "dtype": "fp32",
            "allocator": "x",
            "threads": 1,
            "pinned": None,
            "final_loss": 1,
        },
        {
            "variant": "b",
            "tokens_per_s": 150.0,
            "dtype": "fp32",
            "allocator": "x",
            "threads": 1,
            "pinned": None,
            "final_loss": 1,
        },
        {
            "variant": "a",
            "tokens_per_s": 110.0,
            "dtype": "fp32",
            "allocator": "x",
            "threads": 1,
            "pinned": None,
            "final_loss": 1,
        },
    ]
    table = {r["variant"]: r for r in runs._compare(rows, "a")}
    assert table["a"]["tokens/s (median)"] == 110.0 and table["b"]["vs a"] == pytest.approx(150 / 110)


def test_kernel_benches_compare_medians_per_shape_against_the_baseline():
    """The one-kernel benches (loss_head, norm): baseline median / variant median, per shape."""
    rows = [
        {"shape": "s", "variant": "hf", "ms": 4.0},
        {"shape": "s", "variant": "fused", "ms": 2.0},
        {"shape": "s", "variant": "hf", "ms": 6.0},
        {"shape": "s", "variant": "fused", "ms": 3.0},
        {"shape": "l", "variant": "hf", "ms": 10.0},
        {"shape": "l", "variant": "fused", "ms": 20.0},
    ]
    out = {
        (shape, variant): (len(mine), speed)
        for shape, variant, mine, speed in kernels.against_baseline(rows, "ms", "hf")
    }
    assert list(out) == [("s", "hf"), ("s", "fused"), ("l", "hf"), ("l", "fused")]  # the order run
    assert out[("s", "fused")] == (2, pytest.approx(2.0)) and out[("s", "hf")][1] == 1.0
    assert out[("l", "fused")][1] == pytest.approx(0.5)


def test_interleaved_suites_reverse_their_order_every_other_repetition():
    variants = ["defaults", "a", "b"]
    orders = [common.in_rep_order(variants, rep) for rep in range(4)]
    assert orders == [variants, variants[::-1], variants, variants[::-1]]
    # Over an even number of repetitions each variant holds each place equally often.
    for v in variants:
        assert sorted(order.index(v) for order in orders[:2]) in ([0, 2], [1, 1])


def test_one_kernel_timing_clears_gradients_and_keeps_the_saved_tensors_apart():
    import torch

    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    grads_seen = []

    def run():
        grads_seen.append(x.grad)
        (x @ w).sum().backward()

    timing = kernels.time_kernel_steps(run, [x, w], steps=3)
    assert grads_seen == [None] * 4 and timing["step_ms"] > 0 and timing["faults_per_step"] >= 0
    # x @ w keeps x and w for its backward: nothing else.
    assert kernels.saved_tensor_bytes(lambda: x @ w, [x, w]) == 0
    assert kernels.saved_tensor_bytes(lambda: x @ w) == (64 * 32 + 32 * 32) * 4


def test_reference_run_rejects_an_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        reference.reference_run(common.SIZES["tiny"], "fp16", threads=1, batch=1, steps=1)


def test_reference_suite_matches_dtype_tokens_and_cores_of_the_run(monkeypatch, tmp_path):
    seq = common.SIZES["tiny"]["seq_len"]

    class FakeRunner:
        spec, workdir, runs = common.SIZES["tiny"], tmp_path, []

        def run(self, name, overrides):
            tps = 1000.0 if not self.runs else 1200.0
            self.runs.append(overrides)
            return {"variant": name, "workers": 2, "threads": 1, "dtype": "bf16", "allocator": "system",
                    "tokens_per_s": tps, "step_s": 8 * seq / tps, "final_loss": 7.0}  # fmt: skip

    calls = []

    def fake_reference_run(spec, dtype, threads, batch, steps, compile=False, precision="autocast", **kw):
        calls.append((dtype, threads, batch, compile, precision))
        tps = {"autocast": 800.0, "bf16_master": 1000.0}[precision]
        return {"threads": threads, "dtype": dtype, "precision": precision, "allocator": "system",
                "tokens_per_step": batch * seq, "tokens_per_s": tps, "step_s": batch * seq / tps,
                "forward_s": 0.1, "backward_s": 0.2, "optimizer_step_s": 0.05, "steps_timed": steps,
                "final_loss": 7.6, "grad_clip": 1.0, "attention": "sdpa"}  # fmt: skip

    monkeypatch.setattr(reference, "reference_run", fake_reference_run)
    args = type("Args", (), {"workers": 2, "variants": "", "threads": []})()
    res = reference.suite_reference(FakeRunner(), args)
    assert FakeRunner.runs == [["scaling.num_workers=2"]] * 2  # zero3, references, zero3
    assert calls == [("bf16", 2, 8, False, "autocast"), ("bf16", 2, 8, False, "bf16_master")]
    assert res["best_reference"] == "reference bf16_master" and res["ratio"] == pytest.approx(1.1)
    assert common.write_results("reference", res | {"command": "x", "machine": "y"}, str(tmp_path / "r.json"))


def test_reference_sweeps_threads_per_rank_one_comparison_a_count(monkeypatch, tmp_path):
    """bench reference --workers 1 --threads 1,2: at each count the rank's run, the references at
    as many threads, the rank's run again; one ratio a count against issue 61's 0.9."""
    seq = common.SIZES["tiny"]["seq_len"]

    class FakeRunner:
        spec, workdir, runs = common.SIZES["tiny"], tmp_path, []

        def run(self, name, overrides):
            t = int(overrides[1].rsplit("=", 1)[1])
            self.runs.append((name, overrides))
            tps = 100.0 * t * (0.95 if t == 1 else 0.8)  # falls short at 2 threads
            return {"variant": name, "workers": 1, "threads": t, "dtype": "bf16", "allocator": "system",
                    "tokens_per_s": tps, "step_s": 4 * seq / tps, "final_loss": 7.0}  # fmt: skip

    calls = []

    def fake_reference_run(spec, dtype, threads, batch, steps, compile=False, precision="autocast", **kw):
        calls.append((threads, precision))
        tps = 100.0 * threads * (1.0 if precision == "bf16_master" else 0.9)
        return {"threads": threads, "dtype": dtype, "precision": precision, "allocator": "system",
                "tokens_per_step": batch * seq, "tokens_per_s": tps, "step_s": batch * seq / tps,
                "forward_s": 0.1, "backward_s": 0.2, "optimizer_step_s": 0.05, "steps_timed": steps,
                "final_loss": 7.6, "grad_clip": 1.0, "attention": "sdpa"}  # fmt: skip

    monkeypatch.setattr(reference, "reference_run", fake_reference_run)
    args = type("Args", (), {"workers": 1, "variants": "", "threads": [1, 2]})()
    res = reference.suite_reference(FakeRunner(), args)
    assert [name for name, _ in FakeRunner.runs] == ["zero3-0-t1", "zero3-1-t1", "zero3-0-t2", "zero3-1-t2"]
    assert FakeRunner.runs[2][1] == ["scaling.num_workers=1", "scaling.threads_per_worker=2"]
    assert calls == [(1, "autocast"), (1, "bf16_master"), (2, "autocast"), (2, "bf16_master")]
    assert res["ratios"] == {"1": pytest.approx(0.95), "2": pytest.approx(0.8)} and res["meets_goal"] is False
    sweep = res["tables"]["ZeRO-3 against plain PyTorch at each thread count (goal >= 0.9)"]
    assert [(x["threads per rank"], x["meets goal"]) for x in sweep] == [(1, True), (2, False)]
    path = common.write_results("reference", res | {"command": "x", "machine": "y"}, str(tmp_path / "r.json"))
    assert "| 2 | 1 | 160, 160 | reference bf16_master |" in path.with_suffix(".md").read_text()


def test_thread_counts_must_be_whole_and_fit_the_cores(tmp_path, capsys, no_suites_run):
    assert cli.thread_counts("1, 2,4") == [1, 2, 4]
    for bad in ("0,1", "two", ""):
        with pytest.raises(Exception, match="count|whole"):
            cli.thread_counts(bad)
    out = ["--json", str(tmp_path / "out.json")]
    assert cli.main(["train", "--size", "tiny", "--threads", "1", *out]) == 2
    assert "--threads: only the reference suite sweeps threads, not train" in capsys.readouterr().err
    too_many = str(cli.host_features.cpu_features().usable_cores + 1)
    assert cli.main(["reference", "--size", "tiny", "--workers", "1", "--threads", f"1,{too_many}", *out]) == 2
    assert f"--threads {too_many}: 1 rank(s) x {too_many} threads is more than" in capsys.readouterr().err
    assert no_suites_run == []


def test_result_command_names_the_openmp_settings_both_sides_ran_under(monkeypatch):
    for k in cli.OPENMP_ENV:
        monkeypatch.delenv(k, raising=False)
    assert cli.env_prefix() == ""
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert cli.env_prefix() == "OMP_WAIT_POLICY=active "


def test_scaling_suite_runs_rounds_in_turn_beside_the_hosts_ceiling(monkeypatch, tmp_path):
    """bench scaling --repeats 3: 1 and 2 workers and the host's plain-PyTorch ceiling (1 process,
    then 2 at once) in rounds, in turn first and last; each figure is the median round's."""
    seq = common.SIZES["tiny"]["seq_len"]

    class FakeRunner:
        spec, workdir, runs = common.SIZES["tiny"], tmp_path, []
        speed = iter([1000.0, 1800.0, 1200.0, 700.0, 900.0, 1710.0])  # rounds at 0.9, 0.86 and 0.95

        def run(self, name, overrides):
            self.runs.append(name)
            n = int(overrides[0].rsplit("=", 1)[1])
            tps = next(self.speed)
            return {"variant": name, "workers": n, "threads": 1, "dtype": "bf16", "allocator": "system",
                    "compiled": True, "tokens_per_s": tps, "step_s": n * 4 * seq / tps, "data_wait_s": 0.0,
                    "forward_s": 0.3, "backward_s": 0.6, "optimizer_step_s": 0.1, "comm_s": 0.0, "other_s": 0.0}  # fmt: skip

    calls = []

    def fake_reference_runs(spec, dtype, threads, batch, steps, processes=1, **kw):
        calls.append((dtype, threads, batch, processes, kw["compile"], kw["precision"]))
        FakeRunner.runs.append(f"host-{processes}")
        return [{"tokens_per_s": 500.0 if processes == 1 else 450.0 + 50 * i} for i in range(processes)]

    monkeypatch.setattr(reference, "reference_runs", fake_reference_runs)
    res = reference.suite_scaling(FakeRunner(), type("Args", (), {"repeats": 3})())
    assert FakeRunner.runs == [
        *("scale-1", "scale-2", "host-1", "host-2"),
        *("host-1", "host-2", "scale-2-1", "scale-1-1"),
        *("scale-1-2", "scale-2-2", "host-1", "host-2"),
    ]
    # One worker's micro batch of 4 blocks, 1 thread, the run's dtype, recipe and compile.
    assert set(calls) == {("bf16", 1, 4, 1, True, "bf16_master"), ("bf16", 1, 4, 2, True, "bf16_master")}
    assert res["round_efficiencies"] == pytest.approx([0.9, 1200 / 1400, 0.95])
    assert res["efficiency"] == pytest.approx(0.9)
    assert res["host_efficiency"] == pytest.approx(0.95)  # (450 + 500) / (2 x 500)
    assert res["efficiency_vs_host"] == pytest.approx(0.9 / 0.95)
    assert [x["variant"] for x in res["runs"]] == ["scale-1", "scale-2"] * 3  # by round
    assert common.write_results("scaling", res | {"command": "x", "machine": "y"}, str(tmp_path / "s.json"))


def test_device_goals_table_reads_each_suites_result(tmp_path):
    """benchmarks/device/goals.py reads its four figures from bench's own result files (lease 5's,
    AMX), and a suite that wrote none shows as failed, not as a figure."""
    import importlib.util
    import shutil

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    spec = importlib.util.spec_from_file_location("goals", root / "device" / "goals.py")
    goals = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(goals)
    amx = root / "results" / "intel-xeon-amx_bf16"
    for suite, lease in (("train", "lease5b"), ("reference", "lease5a"), ("seed", "lease5a")):
        shutil.copy(amx / f"{suite}-{lease}.json", tmp_path / f"{suite}.json")
    table, rows = goals.goals_table(tmp_path, "an AMX host", amx=True)
    figures = {r["suite"]: r["value"] for r in rows}
    assert figures["train"] == pytest.approx(0.302, abs=1e-3)  # train-lease5b.md's MFU
    assert figures["reference"] == pytest.approx(0.848, abs=1e-3) and figures["seed"] == pytest.approx(1.29, abs=0.01)
    assert figures["scaling"] is None and "| scaling | 2-worker scaling efficiency | failed" in table
    assert not any(r["met"] for r in rows) and "Not an AMX host" not in table
    # bench scaling's figure is read against the host's own 2-process efficiency, beside it.
    shutil.copy(amx / "scaling-host-native.json", tmp_path / "scaling.json")
    table, rows = goals.goals_table(tmp_path, "an AMX host", amx=True)
    assert rows[-1]["value"] == pytest.approx(0.910, abs=1e-3) and rows[-1]["met"]
    assert "| >= 0.9 | yes | host's own 2-process efficiency 0.878 |" in table


# ----------------------------------------------------------------------------- the command line, checked up front


@pytest.fixture
def no_suites_run(monkeypatch):
    """cli.main with every suite replaced by a recorder: what the checks let through runs nothing."""
    ran: list[str] = []

    def recorder(name: str):
        def suite(runner, args) -> dict:
            ran.append(name)
            return {"tables": {}}

        return suite

    monkeypatch.setattr(cli, "SUITES", {name: recorder(name) for name in cli.SUITES})
    return ran


@pytest.mark.parametrize(
    "argv, message",
    [
        (["options", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["options", "--repeats", "-3"], "--repeats must be >= 1, got -3"),
        (["gemm", "--workers", "0"], "--workers must be >= 1, got 0"),
        (["gemm", "--workers", "-1"], "--workers must be >= 1, got -1"),
        (["options", "--variants", "compile,complie"], "--variants: unknown 'complie'; options knows defaults, "),
        (["dpo", "--variants", "SFT, DPOO"], "--variants: unknown 'DPOO'; dpo knows SFT, DPO, DPO precomputed,"),
        (["gemm", "--variants", "compile"], "--variants: gemm has no variants to pick from"),
        (["train", "train.max_stepz=3"], "train.max_stepz: unknown key in train; did you mean train.max_steps?"),
        (["gemm", "train.max_steps=3"], "train.max_steps=3: key=value overrides apply to training runs, and gemm"),
        (["all", "--json", "{tmp}/all.json"], "--json names one suite's result file; 'all' writes each suite's"),
        (["train", "--json", "/proc/x/a.json"], "--json /proc/x/a.json: cannot create files in /proc"),
        (["train", "--json", "{tmp}"], "--json {tmp}: it is a directory; give --json a writable path"),
        (["train", "--json", "{tmp}/afile/a.json"], "--json {tmp}/afile/a.json: {tmp}/afile is a file"),
        (["train", "--workdir", "{tmp}/afile/wd"], "--workdir {tmp}/afile/wd: {tmp}/afile is a file"),
    ],
)
def test_bad_arguments_stop_before_anything_runs(tmp_path, capsys, no_suites_run, argv, message):
    (tmp_path / "afile").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--json" not in argv:
        argv += ["--json", str(tmp_path / "out.json")]  # never the committed results
    assert cli.main(["--size", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message.replace("{tmp}", str(tmp_path))) and err.count("\n") == 1, err
    assert no_suites_run == [] and not (tmp_path / "out.json").exists()


def test_good_arguments_reach_the_suite_and_its_result_file(tmp_path, capsys, no_suites_run):
    """Names may come with spaces after the commas; the file is --json's, titled by suite and size."""
    out = tmp_path / "new" / "x.json"
    argv = ["options", "--size", "tiny", "--variants", "compile, ZeRO-2", "--workdir", str(tmp_path / "wd")]
    assert cli.main([*argv, "--json", str(out), "train.lr=0.001"]) == 0
    assert no_suites_run == ["options"]
    assert out.with_suffix(".md").read_text().startswith("# raytrain_cpu bench: options-tiny\n")
    args = type("Args", (), {"variants": "compile, ZeRO-2"})()
    assert common.chosen_variants(args) == {"compile", "ZeRO-2"}


def test_training_runs_leave_their_summary_and_drop_their_checkpoints(tmp_path, monkeypatch):
    """No bench resumes a run: its checkpoints go (a 50m one holds ~0.8 GB), unless --keep-checkpoints."""
    run = tmp_path / "runs" / "bench-train-1"
    for part in ("checkpoint_000004/ds", "checkpoint_000008/rng", "base_model"):
        (run / part).mkdir(parents=True)
        (run / part / "f.bin").write_bytes(b"x")
    (run / "summary.json").write_text("{}")
    runs.drop_checkpoints(run)
    assert sorted(p.name for p in run.iterdir()) == ["base_model", "summary.json"]

    kept = []
    monkeypatch.setattr(cli, "SUITES", {"train": lambda runner, args: kept.append(runner.keep_checkpoints) or {}})
    for flag in ([], ["--keep-checkpoints"]):
        assert cli.main(["train", "--size", "tiny", *flag, "--json", str(tmp_path / "t.json")]) == 0
    assert kept == [False, True]


def test_variant_names_are_the_suites_own():
    assert cli.variant_names("options")[0] == "defaults" and "micro batch 4" in cli.variant_names("options")
    assert cli.variant_names("lora") == list(runs.LORA_VARIANTS)
    assert cli.variant_names("dpo") == list(runs.dpo_variants())
    assert cli.variant_names("reference") == ["autocast", "bf16_master", "compile"]
    assert cli.variant_names("gemm") == []


@pytest.mark.parametrize("flag", ["--repeats", "--steps", "--threads", "--tokens"])
def test_kernel_benches_reject_counts_below_one(capsys, flag):
    ap = kernels.kernel_bench_parser("doc", ["s"], steps=3, repeats=2)
    assert ap.parse_args([flag, "4"]).__dict__[flag[2:]] == 4
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as e:
            ap.parse_args([flag, bad])
        assert e.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err
