"""DeepSpeed internals the project reaches into, each where DeepSpeed offers no public route.

DeepSpeed is imported inside the functions: the driver must not import it at start-up.
(The ZeRO-3 optimizer's patches live in compat/deepspeed_zero3.py.)
"""

from __future__ import annotations

from pathlib import Path

from raytrain_cpu.compat import written_for

written_for(__name__, "deepspeed", "0.19")


def own_checkpoint_files(engine, save_dir: str | Path, tag: str) -> list[Path]:
    """The files this rank's `engine.save_checkpoint(save_dir, tag)` writes: its model-state
    file (`engine._get_ckpt_name`) when it saves one, and its ZeRO optimizer shard
    (`engine._get_zero_ckpt_name`) when it saves one. DeepSpeed names them only through these
    private methods; their names are what DeepSpeed's own loader looks for."""
    own = []
    if engine.save_non_zero_checkpoint:
        own.append(Path(engine._get_ckpt_name(str(save_dir), tag)))
    if engine.save_zero_checkpoint:
        own.append(Path(engine._get_zero_ckpt_name(str(save_dir), tag)))
    return own


def comm_backend():
    """The live communication backend DeepSpeed's collectives go through (after
    deepspeed.init_distributed): `deepspeed.comm.comm.cdb`, a module global with no public
    accessor. Its collectives are methods that may be wrapped or replaced."""
    import deepspeed.comm.comm as ds_comm

    return ds_comm.cdb
