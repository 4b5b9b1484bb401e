"""raytrain_cpu.cli: each verb reaches its module's main; no verb trains; an unknown verb is an error."""

from __future__ import annotations

import pytest

from raytrain_cpu import cli


def test_a_verbs_help_is_its_modules_own(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m raytrain_cpu.plan ")


def test_an_unknown_verb_is_refused_with_the_verbs(capsys):
    assert cli.main(["trian", "--config", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raytrain-cpu: unknown verb 'trian'") and "verbs:" in err


def test_no_verb_trains(monkeypatch):
    """`raytrain-cpu --config FILE` and `raytrain-cpu key=value` go to the driver's main, arguments intact."""
    from raytrain_cpu.launch import driver

    seen = []
    monkeypatch.setattr(driver, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["--config", "x.yaml", "train.max_steps=3"]) == 0
    assert cli.main(["train.max_steps=3"]) == 0
    assert cli.main(["train", "--config", "y.yaml"]) == 0
    assert seen == [["--config", "x.yaml", "train.max_steps=3"], ["train.max_steps=3"], ["--config", "y.yaml"]]


def test_help_lists_every_verb(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {verb} " in out for verb in cli.VERBS)
