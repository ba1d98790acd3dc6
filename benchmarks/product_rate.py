"""The fused stored-``K_nM`` product against the read rate of the same memory.

One ``K^T (K u)`` by :func:`gpfalkon.backend.fused.fused_kmn_k` over a whole store of ``--bytes`` (about 1.6 GB,
the reference fit's float32 ``K_nM``) of random values: float32 and float64 stores and int16 fixed-point stores
(:class:`gpfalkon.settings.store_format`) with float32 or float64 row scales, and float32 stores with float64
vectors (``wide``: :class:`gpfalkon.settings.wide_products`, the default for float32 data), at ``--ms``
columns, with 1 and 4 right-hand sides. Each product is timed right after a ``torch.sum`` over the same bytes (as
float32: torch's integer sum is far slower than the memory), alternating, ``--repeats`` times after a warm-up;
reported: the medians, and the product's bytes per second over the sum's (issue 17's target for one
stored-``K`` iteration: at least 0.8). The store's own memory is measured, not a separate buffer's (their rates
differ on these VMs: ``stored-read-diagnosis.md``).

``--against DIR ...``: the same product by the kernel built from each other source tree ``DIR`` (a checkout of
gpfalkon, e.g. ``git archive`` of an earlier commit; its C++ ``fused_kmn_k`` must take the same arguments), timed in
the same process on the same store, in turn with this tree's: a change of the kernel compared without the
allocation-to-allocation spread of the store's read rate on these VMs (product-rate-s49.md's note).

    .venv/bin/python benchmarks/product_rate.py --out benchmarks/results/product-rate.md
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon.backend import fused
from gpfalkon.backend.engine import FIXED_MAX

from _common import environment_lines, log, markdown_table, write_result


def kernel_from(tree: pathlib.Path) -> Any:
    """The built C++ module of ``tree``'s ``gpfalkon.backend.fused`` (built there on first use). Imported by
    putting ``tree`` first on ``sys.path`` with gpfalkon's modules unloaded, then restoring both: the kernel is a
    string inside that module, whose build is named by its own source (no clash with this tree's)."""
    saved = {name: mod for name, mod in sys.modules.items() if name == "gpfalkon" or name.startswith("gpfalkon.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(tree.resolve()))
    try:
        other = importlib.import_module("gpfalkon.backend.fused")
        other._load()
        if other._state["module"] is None:
            raise SystemExit(f"the fused kernel of {tree} could not be built: {other._state['error']}")
        return other._state["module"]
    finally:
        sys.path.pop(0)
        for name in [n for n in sys.modules if n == "gpfalkon" or n.startswith("gpfalkon.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def measure(k_nm: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, k: int, repeats: int,
            others: Sequence[Any] = ()) -> tuple[float, list[float]]:
    """(median seconds of torch.sum over the store's bytes, median seconds of one fused product with vectors of
    ``dtype``: this tree's, then each of ``others``' kernels), each product timed right after a sum."""
    m = k_nm.shape[1]
    u = torch.randn(k, m, dtype=dtype)
    acc = torch.zeros(k, m, dtype=torch.float64)
    flat = k_nm.view(torch.float32) if k_nm.dtype == torch.int16 else k_nm
    empty = u.new_empty(0)
    sc = empty if scale is None else scale
    calls = [lambda: fused.fused_kmn_k(acc, k_nm, u, None, scale)]
    calls += [lambda mod=mod: mod.fused_kmn_k(acc, k_nm, u, empty, sc, fused.FLUSH_ROWS) for mod in others]
    if not calls[0]():
        raise RuntimeError("the fused kernel did not run")
    for call in calls[1:]:
        call()
    flat.sum()
    sums: list[float] = []
    prods: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for times, call in zip(prods, calls, strict=True):
            t = time.perf_counter()
            flat.sum()
            sums.append(time.perf_counter() - t)
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
    return statistics.median(sums), [statistics.median(times) for times in prods]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=float, default=1.6e9, help="bytes of each store (default 1.6e9)")
    ap.add_argument("--ms", nargs="+", type=int, default=[2000, 10_000], help="columns M (default 2,000 10,000)")
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 4], help="right-hand sides (default 1 4)")
    ap.add_argument("--stores", nargs="+", choices=["dtype", "int16", "wide"], default=["dtype", "int16", "wide"],
                    help="store formats: the data's dtype, int16 fixed point, float32 with float64 vectors")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--against", nargs="+", type=pathlib.Path, default=[],
                    help="other source trees whose kernels are timed beside this one's on the same stores")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    env = environment_lines()
    for line in env:
        log(line)
    ok, why = fused.fused_available()
    if not ok:
        raise SystemExit(f"the fused kernel is not available here: {why}")
    others = [kernel_from(tree) for tree in args.against]
    g = torch.Generator().manual_seed(0)
    rows = []
    for m in args.ms:
        for dtype in (torch.float32, torch.float64):
            for store in args.stores:
                if store == "wide" and dtype != torch.float32:
                    continue  # float64 vectors over a float32 store only
                itemsize = 2 if store == "int16" else dtype.itemsize
                n = int(args.bytes // (m * itemsize)) // 8 * 8
                if store == "int16":
                    k_nm = torch.randint(-FIXED_MAX, FIXED_MAX + 1, (n, m), generator=g, dtype=torch.int16)
                    scale = torch.rand(n, generator=g, dtype=dtype) / FIXED_MAX
                else:
                    k_nm, scale = torch.rand(n, m, generator=g, dtype=dtype), None
                nbytes = k_nm.numel() * itemsize
                for k in args.ks:
                    vectors = torch.float64 if store == "wide" else dtype
                    t_sum, t_prods = measure(k_nm, scale, vectors, k, args.repeats, others)
                    row = [f"{m:,}", str(dtype).removeprefix("torch."), store, k, f"{n:,}", nbytes / t_sum / 1e9,
                           nbytes / t_prods[0] / 1e9, t_sum / t_prods[0]]
                    for t_other in t_prods[1:]:
                        row += [nbytes / t_other / 1e9, t_other / t_prods[0]]
                    rows.append(row)
                    log(f"  M={m} {row[1]} {store} k={k}: sum {row[5]:.1f} GB/s, product {row[6]:.1f} GB/s, "
                        f"ratio {row[7]:.3f}" + "".join(f"; {tree}: {row[8 + 2 * j]:.1f} GB/s"
                                                        for j, tree in enumerate(args.against)))
                del k_nm, scale
    labels = [chr(ord("A") + j) for j in range(len(args.against))]
    headers = ["M", "dtype", "store", "k", "rows", "sum GB/s", "product GB/s", "x sum"]
    for label in labels:
        headers += [f"product GB/s ({label})", f"this tree x {label}"]
    trees = "".join(f" {label}: the kernel of `{tree}`, timed in turn with this tree's on the same store."
                    for label, tree in zip(labels, args.against, strict=True))
    body = ("## One fused product against torch.sum over the same store\n\n"
            f"Medians of {args.repeats} alternating pairs after a warm-up; 'x sum' = the product's bytes per "
            "second over the sum's. Store 'wide': float32 values, float64 vectors and sums." + trees + "\n\n"
            + markdown_table(headers, rows, align="rllrrrrr" + "rr" * len(args.against)))
    print(body)
    if args.out is not None:
        log(f"written to {write_result(args.out, 'The fused stored-K product against the read rate', env, body)}")


if __name__ == "__main__":
    main()
