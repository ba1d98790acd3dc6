"""The precision of the engine's float32 matrix products on CUDA (IEEE float32 or TF32).

On Ampere and later NVIDIA GPUs a float32 matmul may run on the tensor cores in TF32 (operands
rounded to a 10-bit mantissa, float32 accumulation): several times the float32 rate, with a
relative error near ``2^-11`` per operand. torch decides by a process-wide flag
(``torch.backends.cuda.matmul.allow_tf32``, also set by
``torch.set_float32_matmul_precision("high")``). gpfalkon's products must not inherit it
silently: the fast path's squared distances ``f |x|^2 + f |c|^2 - 2 f x.c`` cancel, so a
relative error of 5e-4 in the cross term becomes a large error in the kernel values of nearby
points (``benchmarks/results/gpu.md`` measures both on an H100/H200). :func:`matmul_precision` puts
the flag to :class:`gpfalkon.settings.tf32` (default off) around each of the engine's kernel-block
and thin-product matmuls and back after.

The flag is process-wide: another thread's float32 CUDA matmuls running during one of these
products see gpfalkon's value. Written here because torch offers the flag but no scoped form.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .. import settings

__all__ = ["matmul_precision"]


_NULL = contextlib.nullcontext()


def matmul_precision(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Within the block, CUDA float32 matmuls use TF32 iff :class:`gpfalkon.settings.tf32` is on.
    A shared no-op context for other devices (it costs a fraction of a microsecond per block)."""
    if device.type != "cuda":
        return _NULL
    return _cuda_precision()


@contextlib.contextmanager
def _cuda_precision() -> Iterator[None]:
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    flags.allow_tf32 = bool(settings.tf32.value())
    try:
        yield
    finally:
        flags.allow_tf32 = before
