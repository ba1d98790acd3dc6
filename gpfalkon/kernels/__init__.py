"""Kernel arithmetic: the blockwise product engine and its gradients."""
from .autograd import KernelProduct, blockwise_kernel_grad, kernel_params, kernel_product
from .engine import KernelEngine, StationarySpec, kernel_block, stationary_spec
from .fastfood import FastfoodKernel, fwht

__all__ = [
    "FastfoodKernel",
    "KernelEngine",
    "KernelProduct",
    "StationarySpec",
    "blockwise_kernel_grad",
    "kernel_block",
    "kernel_params",
    "kernel_product",
    "stationary_spec",
    "fwht",
]
