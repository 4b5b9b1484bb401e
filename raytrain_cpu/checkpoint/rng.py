"""Each rank's RNG state (torch, numpy, Python), saved as tensors and plain values."""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

from raytrain_cpu.checkpoint.layout import CheckpointError
from raytrain_cpu.compat.numpy import ARRAY_PICKLE_NAMES
from raytrain_cpu.compat.torch import pickled_tensor_class


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def write_rng_state(path: Path, state: dict[str, Any]) -> None:
    """`state` (rng_state) as tensors and plain values, which torch.load reads with weights_only=True."""
    import torch

    name, key, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss_next = state["python"]
    plain = {
        "torch": state["torch"],
        "numpy": {"name": name, "key": torch.from_numpy(key.astype("int64")), "pos": int(pos)},
        "numpy_gauss": [int(has_gauss), float(cached)],
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
    }
    torch.save(plain, path)


def read_rng_state(path: Path) -> dict[str, Any]:
    """rng_state's dict from `path`: written by write_rng_state (torch.load with weights_only=True),
    or a plain pickle of it, as checkpoints made before that (format 2 too) hold; read by an
    unpickler that admits only the tensor and numpy-array classes such a file names, so a
    resume across that upgrade keeps its RNG state and a foreign pickle runs no code."""
    import numpy as np
    import torch

    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # torch.save's zip container
        f.seek(0)
        if not zipped:
            return _RngUnpickler(f).load()
        plain = torch.load(f, weights_only=True)
    n = plain["numpy"]
    py = plain["python"]
    return {
        "torch": plain["torch"],
        "numpy": (n["name"], n["key"].numpy().astype(np.uint32), n["pos"], *plain["numpy_gauss"]),
        "python": (py["version"], tuple(py["state"].tolist()), py["gauss_next"]),
    }


class _RngUnpickler(pickle.Unpickler):
    """Reads an RNG file of the older, pickled form: a dict of a torch byte tensor and numpy's and
    Python's state tuples. Only the classes such a file names are found; a tensor's storage is
    read by torch.load with weights_only=True."""

    def find_class(self, module: str, name: str) -> Any:
        if (tensor_part := pickled_tensor_class(module, name)) is not None:
            return tensor_part
        if (module, name) not in ARRAY_PICKLE_NAMES | {("collections", "OrderedDict")}:
            raise CheckpointError(f"an RNG state file names {module}.{name}, which no RNG state holds; not loaded")
        return super().find_class(module, name)


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
