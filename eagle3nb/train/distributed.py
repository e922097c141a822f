"""03's processes and devices: torchrun's ranks (a plain run is one process), the device each one trains on,
bf16 autocast where the device supports it, and the collectives the loop needs."""

from __future__ import annotations

import os

import torch

from eagle3nb.hf import compute_device


def setup(device: str) -> tuple[int, int, int]:
    """(rank, world, local_rank). torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; a plain run is one process."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if (device.startswith("cuda") or (device == "auto" and compute_device() == "cuda")) \
            else "gloo"
        dist.init_process_group(backend)
    if world > 1:
        return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0"))
    return 0, 1, 0


def pick_device(device: str, local_rank: int = 0) -> torch.device:
    """The device of the ``device`` parameter for this process (``auto``: its GPU when there is one, else CPU)."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if compute_device() == "cuda" else "cpu")
    if device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(device)


def autocast_for(mode: str, device: torch.device):
    """bf16 autocast on CUDA devices that support it ("auto"), forced ("bf16"), or none."""
    on = mode == "bf16" or (mode == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    """``t`` summed over every process (in place; one process: ``t``)."""
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


def wrap(objective: torch.nn.Module, device: torch.device):
    """The objective wrapped for torchrun: gradients all-reduced across processes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(objective, device_ids=[device.index] if device.type == "cuda" else None)


def print_rank0(rank: int, line: str) -> None:
    """A progress line, once per run (from the first process)."""
    if rank == 0:
        print(line, flush=True)
