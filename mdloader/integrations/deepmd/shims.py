"""CPU shims for DeePMD-kit's trainer: its views of ``torch``, ``torch.distributed`` and DDP.

Under ``torchrun`` DeePMD-kit calls ``init_process_group("cuda:nccl,cpu:gloo")``, which fails on
a CPU-only torch, and its DDP set-up assumes a GPU per rank. :class:`ModuleProxy` stands in for
a module the trainer bound at import time, with a few attributes replaced; mdloader itself
imports none of these modules.
"""

from __future__ import annotations

import logging
import types
from typing import Any

from mdloader.distributed.group import create_cpu_groups, stop_while_joining
from mdloader.world import World

log = logging.getLogger(__name__)


class ModuleProxy(types.ModuleType):
    """``real`` with the attributes in ``overrides`` replaced; every other name is ``real``'s."""

    def __init__(self, real: types.ModuleType, **overrides: Any) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(overrides)
        self.__proxied__ = real  # a dunder: no name of the real module is hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__proxied__, name)


def cpu_fallback_backend(backend: Any, dist_module: Any) -> Any:
    """``backend`` with its NCCL part dropped when NCCL or CUDA is unavailable."""
    if not isinstance(backend, str) or "nccl" not in backend:
        return backend
    import torch

    if dist_module.is_nccl_available() and torch.cuda.is_available():
        return backend
    log.info("NCCL/CUDA unavailable: process-group backend %r -> 'gloo'", backend)
    return "gloo"


def trainer_dist(real: types.ModuleType) -> ModuleProxy:
    """DeePMD-kit's ``torch.distributed``: a gloo fallback for NCCL, a group created earlier
    (for mdloader's neighbour statistics) kept, a stop signal honoured while joining it and
    while mdloader's CPU groups are made right after
    (:func:`~mdloader.distributed.group.stop_while_joining`), a barrier before
    ``destroy_process_group`` (gloo may otherwise abort a rank at exit)."""

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if real.is_initialized():
            return None
        with stop_while_joining(World.from_env().rank):
            joined = real.init_process_group(cpu_fallback_backend(backend, real), *args,
                                             **kwargs)
            create_cpu_groups()  # now, while every rank is alive (as mdloader train does)
        return joined

    def destroy_process_group(group: Any = None) -> None:
        if group is None and real.is_initialized() and real.get_world_size() > 1:
            real.barrier()
        real.destroy_process_group(group)

    return ModuleProxy(real, init_process_group=init_process_group,
                       destroy_process_group=destroy_process_group)


def trainer_torch(real: types.ModuleType) -> ModuleProxy:
    """The trainer's ``torch`` without CUDA: ``torch.cuda.set_device`` does nothing (DeePMD-kit
    calls it for every DDP run)."""

    def set_device(device: Any) -> None:
        """Nothing to select on a CPU-only machine."""

    return ModuleProxy(real, cuda=ModuleProxy(real.cuda, set_device=set_device))


def cpu_ddp(real_ddp: type) -> type:
    """DDP that ignores ``device_ids``/``output_device``, which must be None for CPU modules."""

    class CpuDistributedDataParallel(real_ddp):  # type: ignore[misc, valid-type]
        def __init__(self, module: Any, *args: Any, device_ids: Any = None,
                     output_device: Any = None, **kwargs: Any) -> None:
            super().__init__(module, *args, **kwargs)

    return CpuDistributedDataParallel
