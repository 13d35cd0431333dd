"""How batches cross process boundaries: CPU tensors travel as numpy arrays, errors as errors;
and how a batch reaches the trainer's device.

Pickling a tensor through numpy is far cheaper than torch's per-tensor storage pickling and
shared memory, and a DeePMD batch is many small tensors (``docs/benchmarks.md`` has the figures).
Used by the packets of :mod:`mdloader.distributed` and by DataLoader workers.

A DataLoader re-raises a worker's exception in the main process as ``type(exc)(text)``, the
worker's traceback as the only argument: an mdloader error would arrive without its system and
file. A :class:`CarriedError` sends the error itself instead, in place of the batch (the worker
pool of :mod:`mdloader.loading.pool` wraps its reads so).

A batch reaches a CUDA device through pinned memory: the pool's DataLoader pins it when the
trainer's device is CUDA, and :func:`to_device` copies it without blocking the host, so the
copy runs while the host queues the step's kernels. Every copy names its device: nothing lands
on torch's default device.
"""

from __future__ import annotations

from typing import Any

import torch

from mdloader.errors import MdloaderError


def tensor_as_numpy(value: Any) -> Any:
    """A CPU tensor's numpy view (zero copy), or None when numpy cannot hold it."""
    if (type(value) is not torch.Tensor or value.requires_grad or value.device.type != "cpu"
            or value.layout is not torch.strided):
        return None
    try:
        return value.numpy()
    except (TypeError, RuntimeError):  # bfloat16, conjugate views ...
        return None


def non_blocking_copy(source: torch.device, target: torch.device, pinned: bool) -> bool:
    """Whether a copy from ``source`` to ``target`` may run without blocking the host: from
    pinned host memory to a CUDA device only. From pageable memory the host waits for the copy
    anyway, and a copy to the host must be complete before the host reads it."""
    return source.type == "cpu" and target.type == "cuda" and pinned


def to_device(tensor: torch.Tensor, device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` (then as ``dtype``, converted there: fewer bytes cross the bus).

    The copy is asynchronous from pinned memory to a CUDA device (:func:`non_blocking_copy`):
    kernels queued after it on the same stream see the data, and the pinned block is not reused
    before the copy ends (torch's pinned-memory allocator records the copy).
    """
    pinned = device.type == "cuda" and tensor.device.type == "cpu" and tensor.is_pinned()
    moved = tensor.to(device, non_blocking=non_blocking_copy(tensor.device, device, pinned))
    return moved if dtype is None else moved.to(dtype)


def identity(batch: Any) -> Any:
    """The collate function of a DataLoader whose dataset already returns whole batches."""
    return batch


def _rebuild_batch(batch: dict, tensor_keys: tuple[Any, ...]) -> dict:
    """Unpickling side of :class:`TransportBatch`: a plain ``dict``, arrays back to tensors."""
    for k in tensor_keys:
        batch[k] = torch.from_numpy(batch[k])
    return batch


class TransportBatch(dict):
    """A batch ``dict`` that leaves a DataLoader worker with its tensors as numpy arrays.

    Unpickling in the main process rebuilds a plain ``dict`` with ``torch.from_numpy`` (zero
    copy), so the training loop sees the same keys, dtypes, shapes and values as without workers.
    Only top-level CPU tensors are converted; anything else is pickled as usual.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[dict, tuple[Any, ...]]]:
        plain, keys = dict(self), []
        for k, v in plain.items():
            array = tensor_as_numpy(v)
            if array is not None:
                plain[k] = array
                keys.append(k)
        return _rebuild_batch, (plain, tuple(keys))


class CarriedError:
    """An mdloader error raised in a DataLoader worker, travelling to the main process in place
    of the batch it failed to read (the error pickles with its system and file)."""

    __slots__ = ("error",)

    def __init__(self, error: MdloaderError) -> None:
        self.error = error

    def __reduce__(self) -> tuple[Any, tuple[MdloaderError]]:
        return CarriedError, (self.error,)
