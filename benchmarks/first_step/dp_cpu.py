"""``dp`` (DeePMD-kit's own command, its own data path) runnable under torchrun on a CPU-only torch.

Usage: ``torchrun --nproc_per_node=2 -m benchmarks.first_step.dp_cpu --pt train input.json``.

DeePMD-kit 3.2's trainer asks for ``init_process_group("cuda:nccl,cpu:gloo")``, calls
``torch.cuda.set_device`` and gives DDP ``device_ids`` on every torchrun run, none of which a
CPU-only torch accepts. This shim changes only those three calls (gloo, no device, no device ids)
and a barrier before ``destroy_process_group``: the same CPU changes ``mdloader dp`` makes, with
nothing of mdloader's loader, so the benchmark's DeePMD-kit side reads data as DeePMD-kit does.
"""

from __future__ import annotations

import sys
from typing import Any


def install_cpu_fallbacks() -> None:
    """Patch torch and DeePMD-kit's trainer for CPU-only distributed runs (no-op with CUDA)."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        return
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(backend, str) and "nccl" in backend:
            backend = "gloo"
        return real_init(backend, *args, **kwargs)

    def destroy_process_group(group: Any = None) -> None:
        if group is None and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        real_destroy(group)

    dist.init_process_group = init_process_group
    dist.destroy_process_group = destroy_process_group
    torch.cuda.set_device = lambda device: None

    from deepmd.pt.train import training

    real_ddp = training.DDP

    class CpuDDP(real_ddp):  # type: ignore[misc, valid-type]
        def __init__(self, module: Any, *args: Any, device_ids: Any = None,
                     output_device: Any = None, **kwargs: Any) -> None:
            super().__init__(module, *args, **kwargs)

    training.DDP = CpuDDP


def main() -> int:
    install_cpu_fallbacks()
    from deepmd.main import main as dp_main

    dp_main(sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
