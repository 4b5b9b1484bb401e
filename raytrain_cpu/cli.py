"""`raytrain-cpu <verb> [args]`: one console script for every command.

Each verb runs the same code as its `python -m` entry point, which keeps working:

    raytrain-cpu train [--config FILE] [key=value ...]   python -m raytrain_cpu.main
    raytrain-cpu prepare --config FILE                   python -m raytrain_cpu.data prepare
    raytrain-cpu plan --config FILE                      python -m raytrain_cpu.plan
    raytrain-cpu export CHECKPOINT OUT                   python -m raytrain_cpu.export
    raytrain-cpu generate RUN --prompt TEXT              python -m raytrain_cpu.generate
    raytrain-cpu evaluate RUN                            python -m raytrain_cpu.evaluate
    raytrain-cpu report RUN                              python -m raytrain_cpu.report
    raytrain-cpu spot --address ADDR                     python -m raytrain_cpu.spot

Without a verb (`raytrain-cpu --config FILE`), it trains, as the script always did.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# verb -> (module holding main(argv), words put before the rest of the arguments, one line of help)
VERBS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "train": ("raytrain_cpu.launch.driver", (), "train or fine-tune: the whole job, from this driver"),
    "prepare": ("raytrain_cpu.data.cli", ("prepare",), "tokenize and pack the data into the block cache"),
    "plan": ("raytrain_cpu.planner.cli", (), "memory per rank and the nodes a configuration needs"),
    "export": ("raytrain_cpu.model.export", (), "a checkpoint -> a Hugging Face model"),
    "generate": ("raytrain_cpu.model.generate", (), "sample text from a run, checkpoint or export"),
    "evaluate": ("raytrain_cpu.launch.evaluate", (), "evaluate a run or model on held-out data"),
    "report": ("raytrain_cpu.obs.report", (), "a run's metrics as a report with plots"),
    "spot": ("raytrain_cpu.launch.spot", (), "the spot-interruption watcher a node runs"),
}


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [f"  {verb:<{width}}  {what}" for verb, (_, _, what) in VERBS.items()]
    return "usage: raytrain-cpu <verb> [args]   (raytrain-cpu <verb> --help for each)\n\nverbs:\n" + "\n".join(lines)


def entry(verb: str) -> Callable[[list[str]], int]:
    """The verb's main(argv), imported only when it runs (a verb's imports stay its own)."""
    module, before, _ = VERBS[verb]
    main = importlib.import_module(module).main
    return lambda argv: main([*before, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if argv and argv[0] in VERBS:
        return entry(argv[0])(argv[1:])
    if argv and not argv[0].startswith("-") and "=" not in argv[0]:
        print(f"raytrain-cpu: unknown verb {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return entry("train")(argv)  # no verb: train, as `raytrain-cpu --config FILE` always did


if __name__ == "__main__":
    raise SystemExit(main())
