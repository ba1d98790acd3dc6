"""Moved to :mod:`gpfalkon.backend.engine` (the data backend); this module re-exports its names."""
from ..backend.engine import KernelEngine, StationarySpec, kernel_block, stationary_spec

__all__ = ["KernelEngine", "StationarySpec", "kernel_block", "stationary_spec"]
