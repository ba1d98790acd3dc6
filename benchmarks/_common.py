"""Helpers shared by the benchmark scripts (not part of the library).

Markdown tables without third-party dependencies, a description of the machine,
timing helpers and writing a result file that records how it was produced.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def total_ram_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def command_line() -> str:
    """The command that ran, with the ``GPFALKON_*`` environment variables it ran under (they change
    what the library does, e.g. ``GPFALKON_FUSED_CPU=0``), so that the line re-runs the same thing."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("GPFALKON_")]
    return " ".join([*env, *(shlex.quote(a) for a in [os.path.relpath(sys.executable, os.getcwd()), *sys.argv])])


def environment_lines() -> list[str]:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    try:
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    return [
        f"- command: `{command_line()}` (cwd `{os.getcwd()}`)",
        f"- date: {now}",
        f"- torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
        f"os.cpu_count() = {os.cpu_count()}",
        f"- CPU: {cpu_model()}; total RAM {total_ram_gib():.1f} GiB",
        *gpu_lines(),
        f"- load average at start (1/5/15 min): {load}",
    ]


def gpu_lines() -> list[str]:
    """The CUDA devices torch sees (name, memory, compute capability, CUDA version), if any."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(f"- GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
                   f"compute capability {p.major}.{p.minor}; CUDA {torch.version.cuda}")
    return out


def fmt(x, digits: int = 3) -> str:
    """Compact number formatting for tables (``-`` for None / NaN)."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if x != x:  # NaN
        return "-"
    ax = abs(x)
    if ax == 0:
        return "0"
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 0.01:
        return f"{x:#.{digits}g}" if ax < 1 else f"{x:.{digits - 1}f}"
    return f"{x:.2e}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
    """A GitHub-flavoured markdown table; ``align`` is one char per column (l/r)."""
    cells = [[fmt(c) for c in row] for row in rows]
    if align is None:
        align = "l" + "r" * (len(headers) - 1)
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(headers)]

    def line(items):
        return "| " + " | ".join(
            (s.ljust(w) if a == "l" else s.rjust(w)) for s, w, a in zip(items, widths, align, strict=False)
        ) + " |"

    sep = "|" + "|".join(
        ("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1)) for w, a in zip(widths, align, strict=False)
    ) + "|"
    return "\n".join([line([str(h) for h in headers]), sep, *(line(r) for r in cells)])


def timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    """Run ``fn`` once; return (wall seconds, process CPU seconds, result)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def median_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``repeats`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def matmul_gflops(dtype: torch.dtype, size: int = 4096, repeats: int = 3) -> float:
    """torch.matmul throughput (GFLOP/s) on ``size x size`` matrices, median of ``repeats``."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(size, size, generator=g, dtype=torch.float64).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    med, _ = median_time(lambda: torch.matmul(a, b, out=out), repeats=repeats, warmup=1)
    return 2.0 * size**3 / med / 1e9


def read_bandwidth(nbytes: int = 2**30, repeats: int = 3) -> float:
    """Memory read rate (GB/s): ``torch.sum`` over a buffer of ``nbytes`` (far larger than any
    cache), read once as float32 and once as float64 (the same bytes), median of ``repeats`` after
    one warm-up each, all of torch's threads; the faster of the two. torch's float32 sum can be
    bound by its own arithmetic below the memory rate (on an AMD EPYC host: 35.6 GB/s against
    62.0 GB/s for the float64 sum of the same buffer), so taking only one would flatter anything
    compared with it."""
    buf = torch.ones(max(2, nbytes // 8) * 2, dtype=torch.float32)
    rates = []
    for view in (buf, buf.view(torch.float64)):
        med, _ = median_time(view.sum, repeats=repeats, warmup=1)
        rates.append(buf.numel() * 4 / med / 1e9)
    del buf
    return max(rates)


def tensor_read_rate(t: torch.Tensor, repeats: int = 3) -> float:
    """The read rate (GB/s) of ``t``'s own memory, as :func:`read_bandwidth` measures it (``torch.sum``
    over its bytes as ``t``'s dtype and, where they allow it, as float64; the faster; median of
    ``repeats`` after one warm-up). The rate depends on the pages behind a tensor
    (``benchmarks/results/stored-read-diagnosis.md``), so a product over ``t`` is best compared with
    this rather than with a separately allocated buffer. ``t`` must be contiguous."""
    flat = t.reshape(-1)
    views = [flat]
    if flat.dtype != torch.float64 and (flat.numel() * flat.element_size()) % 8 == 0:
        views.append(flat.view(torch.float64))
    rates = []
    for view in views:
        med, _ = median_time(view.sum, repeats=repeats, warmup=1)
        rates.append(flat.numel() * flat.element_size() / med / 1e9)
    return max(rates)


def exp_rate(dtype: torch.dtype, block_bytes: int = 2**19, total: int = 2**26, repeats: int = 3) -> float:
    """In-place ``torch.exp_`` throughput (elements/s) on a cache-resident block of ``block_bytes``,
    repeated until ``total`` elements are done: the arithmetic cost of a kernel's exp, without the
    memory traffic. Median of ``repeats`` after one warm-up; all of torch's threads."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    block = torch.full((block_bytes // itemsize,), -0.5, dtype=dtype)
    rounds = max(1, total // block.numel())

    def run() -> None:
        for _ in range(rounds):
            block.fill_(-0.5).exp_()

    med, _ = median_time(run, repeats=repeats, warmup=1)
    return rounds * block.numel() / med


def dataset_run_arguments(description: str, budget: float, many_splits: bool = False) -> argparse.ArgumentParser:
    """The command line of a per-dataset ``auto_fit`` study: ``--datasets`` (``compare.py``'s built-in names),
    ``--budget`` seconds, ``--split`` (``compare.py``'s; ``--splits``, one or more, with ``many_splits``), ``--seed``
    and ``--out``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--datasets", nargs="+", required=True)
    p.add_argument("--budget", type=float, default=budget)
    if many_splits:
        p.add_argument("--splits", nargs="+", type=int, default=[0])
    else:
        p.add_argument("--split", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p


def predictive_scores(model, xte: torch.Tensor, yte: torch.Tensor) -> dict[str, float]:
    """A fitted gpfalkon model's test NRMSE (RMSE / std of ``yte``) and NLPD (its predictive distribution, noise
    included: the likelihood of its posterior), in float64."""
    import math

    model.eval()
    with torch.no_grad():
        pred = model.likelihood(model(xte))
        mean, var = pred.mean.double(), pred.variance.double()
    res = mean - yte.double()
    return dict(nrmse=float(res.square().mean().sqrt() / yte.double().std()),
                nlpd=float((0.5 * torch.log(2 * math.pi * var) + 0.5 * res.square() / var).mean()))


def ratio_summary(ratios: Sequence[float], label: str = "on / off") -> str:
    """``**Geometric mean of <label>: g** over N runs (L lower, H higher, largest R)`` of an A/B study's ratios."""
    import math

    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else math.nan
    return (f"**Geometric mean of {label}: {geo:.3f}** over {len(ratios)} runs ({sum(r < 1 for r in ratios)} lower, "
            f"{sum(r > 1 for r in ratios)} higher, largest {max(ratios, default=math.nan):.3f})")


def split_datasets(names: Sequence[str], split: int, *, max_rows: int | None = None,
                   task: str | None = None) -> Iterator[tuple[str, dict]]:
    """``(name, data)`` of each of ``compare.py``'s datasets ``names`` on its split ``split``
    (``compare.load_dataset``); ``SystemExit`` naming ``--datasets`` where a set has more than ``max_rows`` training
    rows or is not a ``task`` task."""
    import compare

    compare.SPLIT["k"] = split
    for name in names:
        data = compare.load_dataset(name)
        n = data["xtr"].shape[0]
        if max_rows is not None and n > max_rows:
            raise SystemExit(f"--datasets: {name} has {n:,} training rows; this study's exact solves allow "
                             f"{max_rows:,}")
        if task is not None and data["task"] != task:
            raise SystemExit(f"--datasets: {name} is a {data['task']} task; this study is for {task}")
        yield name, data


def empty_jsonl(out: str | pathlib.Path) -> pathlib.Path:
    """``out`` with the suffix ``.jsonl``, its folder made and the file emptied: a study appends a line per run
    as it ends, so a run stopped part-way leaves its finished rows."""
    jsonl = pathlib.Path(out).with_suffix(".jsonl")
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("")
    return jsonl


def log(msg: str) -> None:
    print(msg, flush=True)


def write_result(path: pathlib.Path, title: str, env: Sequence[str], body: str) -> pathlib.Path:
    """Write ``title``, the environment lines ``env`` (from :func:`environment_lines`,
    taken when the run started) and ``body`` to ``path`` (parents created)."""
    path = pathlib.Path(path)
    if not path.is_absolute():
        path = pathlib.Path(os.getcwd()) / path
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# {title}\n\n" + "\n".join(env) + "\n\n" + body.rstrip() + "\n"
    path.write_text(text)
    return path


def protein_split0(rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """protein (embedded ``data/protein.npz``), split 0, the first ``rows`` training rows (all when
    ``None``), standardised with the training rows' statistics: ``(x, y, x_test, y_test)`` float64."""
    import numpy as np

    with np.load(REPO / "data" / "protein.npz") as z:
        X, Y, mask = z["X"], z["y"], z["test_mask"][:, 0]
    x, y = torch.as_tensor(X[~mask])[:rows], torch.as_tensor(Y[~mask])[:rows]
    xt, yt = torch.as_tensor(X[mask]), torch.as_tensor(Y[mask])
    mu, sd = x.mean(0), x.std(0)
    ym, ys = y.mean(), y.std()
    return (x - mu) / sd, (y - ym) / ys, (xt - mu) / sd, (yt - ym) / ys
