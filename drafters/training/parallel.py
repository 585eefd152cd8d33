"""Processes: how a command started by `accelerate launch` or torchrun finds its share of the work.

    accelerate launch --multi_gpu --num_processes N -m drafters.training.train ...   # N processes (GPUs, or CPUs)
    torchrun --nproc_per_node N -m drafters.training.train ...                       # the same without accelerate

Training is data-parallel (`training_accelerator`): every process builds the whole step's batch from the same seeded
generator and trains on its rows (`step_share`), and DDP all-reduces the gradients, so N processes take the steps one
process takes. `accelerate launch --cpu --num_processes N` starts ONE process unless mpirun is installed (accelerate
1.15); `started_alone_by_accelerate` tells, and the commands warn.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

# How long a process waits at a collective for the others: the main process generates the answers and features alone
# (hours on a CPU), and torchrun stops every worker when one fails, so nothing waits on a dead process.
STAGE_TIMEOUT = timedelta(hours=48)


def started_alone_by_accelerate() -> bool:
    """accelerate's CPU launcher without mpirun: it sets MASTER_PORT (only when asked for N > 1
    processes) but starts one process, so no WORLD_SIZE reaches it."""
    asked_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return asked_cpu and "MASTER_PORT" in os.environ and "WORLD_SIZE" not in os.environ


def warn_if_started_alone(processes: int, running: str) -> None:
    """Say so when `accelerate launch --cpu --num_processes N` started one process; `running`: what it does instead."""
    if processes == 1 and started_alone_by_accelerate():
        print(
            "warning: `accelerate launch --cpu --num_processes N` started a single process (it needs mpirun for more); "
            f"{running}. For N processes on the CPU use `accelerate launch --multi_gpu --num_processes N` "
            "or `torchrun --nproc_per_node N`",
            file=sys.stderr,
        )


def training_accelerator(device: str):
    """The `Accelerator` of a training run: one process on `device` unless started by `accelerate launch` or torchrun
    (then one per process, on the CPU when `device` is the CPU)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    accelerator = Accelerator(
        cpu=torch.device(device).type == "cpu",
        mixed_precision="no",  # the drafter trains in float32, whatever a launch config says
        device_placement=False,  # train() puts the model and each batch on its device itself
        kwargs_handlers=[InitProcessGroupKwargs(timeout=STAGE_TIMEOUT)],
    )
    warn_if_started_alone(accelerator.num_processes, "training in one process")
    return accelerator


def step_share(batch: dict[str, torch.Tensor], rank: int, processes: int) -> dict[str, torch.Tensor]:
    """Process `rank`'s rows of a step's batch: a contiguous run of its sequences (all of them in one process)."""
    return {name: tensor.tensor_split(processes)[rank] for name, tensor in batch.items()}
