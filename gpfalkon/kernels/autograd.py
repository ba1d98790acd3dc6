"""Moved to :mod:`gpfalkon.backend.autograd` (the data backend); this module re-exports its names."""
from ..backend.autograd import KernelProduct, blockwise_kernel_grad, kernel_params, kernel_product, scatter_grads

__all__ = ["KernelProduct", "blockwise_kernel_grad", "kernel_params", "kernel_product", "scatter_grads"]
