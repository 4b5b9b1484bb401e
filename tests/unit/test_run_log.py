"""A worker's choice lines (which kernel or path each choice took) go to the run's run.log, and
summary.json's `choices` reads them back; progress stays on the console."""

from __future__ import annotations

from raytrain_cpu.obs import metrics


def test_choice_lines_go_to_run_log_and_progress_to_the_console(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics, "_choice_log", [])
    metrics.console("[rank 0] [model] attention: fused")  # no run directory named yet: the console
    assert capsys.readouterr().out == "[rank 0] [model] attention: fused\n"

    metrics.log_choices(tmp_path)
    start = metrics.run_log_size(tmp_path)
    for line in (
        "[rank 0] cpu: AMD EPYC (avx2); 1 intra-op + 1 inter-op threads; dtype bf16",
        "[rank 1] cpu: AMD EPYC (avx2); 1 intra-op + 1 inter-op threads; dtype bf16",
        "[rank 0] collectives: shared memory among 2 ranks",
        "[rank 0] [load] loading /x/base_model into ZeRO-3 shards on 2 ranks",
        "[rank 0] [engine] ZeRO-3 gathers whole layers: LlamaDecoderLayer",
        "[rank 0] [model] loss: fused with the output layer",
        "[rank 0] [model] loss: fused with the output layer",  # a restarted worker group says it again
    ):
        metrics.console(line)
    metrics.console("[rank 0] step 1/2 | loss 7.6")
    metrics.console("[rank 0] [load] sharded load done in 1.0s")
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] step 1/2 | loss 7.6",
        "[rank 0] [load] sharded load done in 1.0s",
    ]
    choices = metrics.read_choices(tmp_path, start)
    assert len(choices) == 6 and choices[0].startswith("[rank 0] cpu: ") and choices[-1].endswith("output layer")
    assert metrics.read_choices(tmp_path, metrics.run_log_size(tmp_path)) == []
    assert metrics.read_choices(tmp_path / "nowhere") == []
