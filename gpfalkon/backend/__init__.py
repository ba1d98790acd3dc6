"""The data backend: every pass over the ``n`` rows goes through this package.

* :mod:`~gpfalkon.backend.blocks` - the one block-size rule and the one row-block iterator;
* :mod:`~gpfalkon.backend.engine` - :class:`KernelEngine`, the in-memory backend: blockwise
  ``K_nM^T (K_nM U + V)``, ``K_nM U``, ``K_MM`` and the stationary-kernel fast path;
* :mod:`~gpfalkon.backend.autograd` - the blockwise gradient pass and the differentiable
  kernel product built on it;
* :mod:`~gpfalkon.backend.stationary_grad` - the differentiable kernel block with a hand-written backward for
  RBF and Matern 3/2, 5/2 kernels (others: through GPyTorch), which the differentiable passes use;
* :mod:`~gpfalkon.backend.passes` - the passes whose blocks go through GPyTorch (or the block above): the
  objectives' differentiable aggregates (``A A^T``, ``A y``, ``tr K~``, ``tr K_nn``), per-block
  maps (``S_ii``), blockwise ``k(x, C) alpha`` (prediction, hold-out), the kernel diagonal and
  BLESS's whitened norms;
* :mod:`~gpfalkon.backend.sources` - row sources: training inputs read block by block from
  ``.npy`` or Parquet files (data larger than memory), and their per-rank shards;
* :mod:`~gpfalkon.backend.prefetch` - a source's blocks on a GPU, read into pinned memory and
  copied on a side CUDA stream ahead of the compute;
* :mod:`~gpfalkon.backend.precision` - IEEE float32 or TF32 for the engine's CUDA matmuls
  (:class:`gpfalkon.settings.tf32`);
* :mod:`~gpfalkon.backend.distributed` - :class:`DistributedBackend`, the row-sharded backend on
  ``torch.distributed`` (one ``all_reduce`` per pass).

It imports nothing from the rest of gpfalkon except :mod:`gpfalkon.settings` and :mod:`gpfalkon.errors`.
"""
from .autograd import KernelProduct, blockwise_kernel_grad, kernel_params, kernel_product, scatter_grads
from .blocks import (
    AGGREGATE,
    FACTOR,
    GRADIENT,
    PRODUCT,
    STORED,
    BlockProfile,
    block_rows_for,
    keeps_graph,
    memory_budget_for,
    resolve_block_rows,
    row_blocks,
    stored_batch,
)
from .distributed import DistributedBackend, ShardedEngine, init_distributed, shard_range
from .engine import KernelEngine, StationarySpec, kernel_block, stationary_spec, stored_rows_for
from .passes import (
    WhitenedAggregates,
    kernel_diagonal,
    kernel_matmul,
    map_whitened_blocks,
    whitened_aggregates,
    whitened_sq_norms,
)
from .precision import matmul_precision
from .prefetch import row_slices, source_blocks
from .sources import NpyRows, ParquetRows, RowSource, SliceRows, TensorRows, shard_files, shard_rows

__all__ = [
    "AGGREGATE",
    "FACTOR",
    "GRADIENT",
    "PRODUCT",
    "STORED",
    "BlockProfile",
    "DistributedBackend",
    "KernelEngine",
    "KernelProduct",
    "NpyRows",
    "ParquetRows",
    "RowSource",
    "ShardedEngine",
    "SliceRows",
    "StationarySpec",
    "TensorRows",
    "WhitenedAggregates",
    "block_rows_for",
    "blockwise_kernel_grad",
    "init_distributed",
    "keeps_graph",
    "kernel_block",
    "kernel_diagonal",
    "kernel_matmul",
    "kernel_params",
    "kernel_product",
    "map_whitened_blocks",
    "matmul_precision",
    "memory_budget_for",
    "resolve_block_rows",
    "row_blocks",
    "row_slices",
    "scatter_grads",
    "shard_files",
    "shard_range",
    "shard_rows",
    "source_blocks",
    "stationary_spec",
    "stored_batch",
    "stored_rows_for",
    "whitened_aggregates",
    "whitened_sq_norms",
]
