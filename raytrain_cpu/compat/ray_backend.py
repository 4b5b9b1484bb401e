"""Ray Train's torch process group on gloo, set up without importing torch in Ray Train's
controller; and a TorchTrainer that starts only the helper actors a run uses.

The controller unpickles the trainer's backend config. `ray.train.torch.TorchConfig`'s module
imports torch at the top, so every run's controller imported torch (over a second of CPU on the
path from `fit()` to the workers' start) to send the workers three small functions. GlooConfig
does what TorchConfig(backend="gloo") does on CPUs (Ray 2.60's `_TorchBackend`): worker 0's
address and a free port as MASTER_ADDR / MASTER_PORT, RANK / LOCAL_RANK / WORLD_SIZE /
LOCAL_WORLD_SIZE / NODE_RANK from the Ray Train context, `init_process_group("gloo")` with the
run's timeout on every worker, and at shutdown the group destroyed within
TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S (a hung peer is killed after that).

`BackendConfig` and `Backend` are Ray Train's developer API; the worker group's `execute*`
methods that a Backend calls are what Ray's own backends call, not a documented API: hence here.

Beside its workers, a Ray Train run starts helper actors, each a process of its own that imports
Ray (a sizeable share of a tiny run's CPU on a small host). `LeanTorchTrainer` leaves out the two
a run can do without. Ray Train 2.60 builds them as default callbacks
(`DataParallelTrainer._create_default_callbacks`, private), so they are filtered there:
- the dataset manager (`DatasetsCallback`, one an attempt), which Ray Train starts with no
  datasets too: the workers read their own blocks (`data.stream`), so the trainer is given none;
- the placement-group cleaner (`PlacementGroupCleanerCallback`, one a run), a detached actor that
  frees the workers' placement group should the controller die while the driver lives on. Ray
  frees a job's placement groups when its driver exits, as a command-line run's does with the
  run; the cleaner matters where one process starts run after run (a notebook, a test session).
  Kept unless `run.placement_group_cleaner=false`.

Imported only where the trainer is built (it imports `ray.train`).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from raytrain_cpu.compat import written_for

written_for(__name__, "ray", "2.60")

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_ENV = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"  # Ray's own knob, honoured as Ray does
SHUTDOWN_TIMEOUT_DEFAULT_S = 30


@dataclass
class GlooConfig(BackendConfig):
    """The trainer's backend config (LeanTorchTrainer's `backend_config`; TorchTrainer takes it as
    `torch_config`) for a gloo process group whose collectives time out after `timeout_s`."""

    timeout_s: int = 1800
    backend: str = "gloo"  # TorchTrainer reads it (and picks nccl where it is empty and GPUs are asked for)

    @property
    def backend_cls(self) -> type[Backend]:
        return GlooBackend

    def to_dict(self) -> dict:
        return {"backend": self.backend, "timeout_s": self.timeout_s}


class GlooBackend(Backend):
    def on_start(self, worker_group, backend_config: GlooConfig) -> None:  # noqa: ANN001 - Ray's worker group
        addr, port = worker_group.execute_single(0, _address_and_port)
        worker_group.execute(_set_distributed_env, addr=addr, port=port)
        world = len(worker_group)
        ray.get(
            [
                worker_group.execute_single_async(
                    i, _init_process_group, world_rank=i, world=world, timeout_s=backend_config.timeout_s
                )
                for i in range(world)
            ]
        )

    def on_shutdown(self, worker_group, backend_config: GlooConfig) -> None:  # noqa: ANN001
        futures = worker_group.execute_async(_destroy_process_group, several=len(worker_group) > 1)
        timeout_s = int(os.environ.get(SHUTDOWN_TIMEOUT_ENV, SHUTDOWN_TIMEOUT_DEFAULT_S))
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")


# ----------------------------------------------------------------------------- the trainer


class LeanTorchTrainer(DataParallelTrainer):
    """What `TorchTrainer(torch_config=GlooConfig(...))` is (TorchTrainer is DataParallelTrainer
    with a torch backend config; its module imports torch, this one's does not), less a dataset
    manager when given no datasets, and less the placement-group cleaner unless
    `placement_group_cleaner` (module docstring). Takes the backend as `backend_config`."""

    def __init__(self, *args, placement_group_cleaner: bool = True, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._placement_group_cleaner = placement_group_cleaner

    def _create_default_callbacks(self) -> list:
        unused = () if self.datasets else (DatasetsCallback,)
        unused += () if self._placement_group_cleaner else (PlacementGroupCleanerCallback,)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]


# ----------------------------------------------------------------------------- run on the workers


def _address_and_port() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def _set_distributed_env(addr: str, port: int) -> None:
    context = ray.train.get_context()
    os.environ |= {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": str(context.get_world_rank()),
        "WORLD_SIZE": str(context.get_world_size()),
        "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "NODE_RANK": str(context.get_node_rank()),
    }


def _init_process_group(world_rank: int, world: int, timeout_s: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method="env://", rank=world_rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _destroy_process_group(several: bool) -> None:
    import torch.distributed as dist

    if several and dist.is_initialized():
        dist.destroy_process_group()
