"""Transparent huge pages for a stored ``K_nM``: measured, and left out of the library.

A fresh host tensor of ``n M`` float32 values (1.6 GB by default) is allocated, optionally advised
(``madvise``), written once (``fill_``: page faults and zeroing) and released, ``--allocations`` times in one
process; each variant runs in its own fresh processes (``--processes`` each, alternating), since a process's
first allocation is where the variants differ. Variants: plain pages; ``MADV_HUGEPAGE`` on the 2 MiB-aligned
interior (transparent huge pages, where the kernel's mode is ``madvise`` or ``always``);
``MADV_POPULATE_WRITE`` (the pages faulted in by one system call, Linux >= 5.14), also split over two
threads (one call per half, whether faulting scales with threads). Linux only.

    .venv/bin/python benchmarks/hugepages.py --out benchmarks/results/hugepages.md
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import environment_lines, log, markdown_table, write_result

MADV = {"plain": None, "huge pages (MADV_HUGEPAGE)": 14, "populate (MADV_POPULATE_WRITE)": 23,
        "populate, 2 threads (each half)": 23}


def child(variant: str, n: int, allocations: int) -> list[tuple[float, float]]:
    """(write s, release s) of each allocation in this process."""
    import ctypes

    import torch

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advice = MADV[variant]
    out = []
    for _ in range(allocations):
        t0 = time.perf_counter()
        x = torch.empty(n, dtype=torch.float32)
        if advice is not None:
            a, nbytes = x.data_ptr(), n * 4
            huge = 2 * 2**20 if advice == 14 else 4096
            start, stop = -(-a // huge) * huge, (a + nbytes) // huge * huge
            parts = 2 if "2 threads" in variant else 1
            cut = [start + (stop - start) * i // parts // huge * huge for i in range(parts)] + [stop]
            errors: list[int] = []

            def advise(lo: int, hi: int, errors: list[int] = errors) -> None:
                if libc.madvise(lo, hi - lo, advice) != 0:  # ctypes releases the GIL during the call
                    errors.append(ctypes.get_errno())

            workers = [threading.Thread(target=advise, args=(cut[i], cut[i + 1])) for i in range(parts)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if errors:
                raise OSError(errors[0], f"madvise {variant}")
        x.fill_(1.0)
        t1 = time.perf_counter()
        del x
        out.append((t1 - t0, time.perf_counter() - t1))
    return out


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--m", type=int, default=2_000)
    ap.add_argument("--allocations", type=int, default=4, help="allocations per process")
    ap.add_argument("--processes", type=int, default=3, help="fresh processes per variant")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/hugepages.md"))
    args = ap.parse_args()
    n = args.n * args.m
    if args.child:
        print(json.dumps(child(args.child, n, args.allocations)))
        return
    env = [*environment_lines(), f"- transparent huge pages: `{thp_mode()}`"]
    runs: dict[str, list[list[tuple[float, float]]]] = {v: [] for v in MADV}
    for p in range(args.processes):
        for variant in (list(MADV) if p % 2 == 0 else list(MADV)[::-1]):
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--n", str(args.n), "--m",
                                  str(args.m), "--allocations", str(args.allocations)],
                                 capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"[{variant}] {runs[variant][-1]}")
    rows = []
    for variant, procs in runs.items():
        first = [r[0] for r in procs]
        later = [a for r in procs for a in r[1:]]
        rows.append([variant, statistics.median(w for w, _ in first), statistics.median(w for w, _ in later),
                     statistics.median(d for _, d in later)])
    body = [f"{n * 4 / 1e9:.1f} GB float32 tensors; {args.processes} fresh processes per variant, "
            f"{args.allocations} allocations in each; medians.", "",
            markdown_table(["variant", "first allocation's write s", "later allocations' write s", "release s"],
                           rows, align="lrrr"), "",
            "Each process's allocations (write s + release s), in run order:", ""]
    for variant, procs in runs.items():
        body.append(f"- {variant}: " + " | ".join(" ".join(f"{w:.2f}+{d:.3f}" for w, d in r) for r in procs))
    path = write_result(args.out, "Transparent huge pages for a stored K_nM", env, "\n".join(body))
    log(f"written {path}")


if __name__ == "__main__":
    main()
