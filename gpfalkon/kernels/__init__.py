"""Kernels: the Fastfood random-feature kernel; the engine names are re-exported from
:mod:`gpfalkon.backend`, where the data passes live."""
from ..backend import (
    KernelEngine,
    KernelProduct,
    StationarySpec,
    blockwise_kernel_grad,
    kernel_block,
    kernel_params,
    kernel_product,
    stationary_spec,
)
from .fastfood import FastfoodKernel, fwht

__all__ = [
    "FastfoodKernel",
    "KernelEngine",
    "KernelProduct",
    "StationarySpec",
    "blockwise_kernel_grad",
    "fwht",
    "kernel_block",
    "kernel_params",
    "kernel_product",
    "stationary_spec",
]
