"""auto_fit's final fit on flights on a GPU (issue 17, part 1; session 52): the on-the-fly timing probe and the
CG products over a stored float32 ``K_nM``.

Usage (on a machine with a CUDA GPU; ``GPFALKON_DATA`` holds ``flights.npz``)::

    python benchmarks/gpu_flights_final_fit.py probe --out OUT   # writes OUT/probe.json and OUT/final.pt
    python benchmarks/gpu_flights_final_fit.py sums --final OUT/final.pt --out OUT   # writes OUT/sums.json

``probe``: one on-the-fly pass ``K_Mn (K_nM u)`` (50,000 rows, 4,000 centers) timed twice through one engine in a
fresh process (the first pays the Triton compilation), and the probe auto_fit uses (``_onthefly_pass_seconds``),
then ``auto_fit`` on flights with ``compare.py``'s split and a ``--budget`` (default 35 s) twice in the same
process, each model's test NRMSE on the whole test set, its report's notes, and the first run's final model
(its kernel, centers, noise, rows) saved for ``sums``.

``sums``: the saved final configuration refitted on as many random training rows as it had (its centers, kernel
and noise; center weights not kept; a file of session 52 holds the kernel's state only: auto_fit's default
family, ``--kernel-family``, is rebuilt with its log-lengthscale parametrisation to load it), exactly
``--iterations`` CG iterations (``tol=0``; ``--fit-rows``: on that many rows instead), each variant's CG
residuals, fit seconds and test NRMSE: float32 products over the stored ``K_nM`` with each row sum taken over all
rows in float32 (the engine before session 52: ``FLUSH_ROWS`` set past the rows), the same flushed to float64 every
``FLUSH_ROWS`` rows (the engine now), float64 products (``settings.wide_products``, where the engine in use applies
them on the GPU: ``gpu-h200-s52-wide-cuda.patch``), float64 data; then ``auto_fit`` on flights once
(``--no-auto`` skips it). ``--device cpu --rows N`` runs both at toy sizes anywhere.
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import compare


def _data(device: str, rows: int) -> dict:
    data = compare.load_dataset("flights")
    if rows:
        data = dict(data, **{k: data[k][:rows] for k in ("xtr", "ytr", "xte", "yte")})
    return compare.to_device(data, device)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _test_error(model, data: dict, dtype: torch.dtype) -> tuple[float, float]:
    """(test NRMSE over the whole test set, the largest |standardised prediction|)."""
    model.eval()
    raw = compare.predict_chunks(lambda z: model.posterior_mean(z.to(dtype)), data["xte"])
    s = (raw - data["y_mean"]) / data["y_scale"]
    return compare.metrics(data, s)["error"], float(s.abs().max())


def _auto_row(data: dict, budget: float) -> tuple[dict, object]:
    from gpfalkon import auto_fit

    ytr = data["ytr"].double() * data["y_scale"] + data["y_mean"]
    _sync(str(data["xtr"].device))
    t = time.perf_counter()
    model = auto_fit(data["xtr"], ytr, budget=budget, seed=0)
    _sync(str(data["xtr"].device))
    seconds = time.perf_counter() - t
    err, top = _test_error(model, data, torch.float32)
    c = model.auto_report.chosen
    fi = model.fit_info
    return dict(fit_s=seconds, test_nrmse=err, max_abs_pred=top, M=c["num_centers"], final_rows=c["final_rows"],
                noise=c["noise"], final_iterations=fi.iterations, final_residual=float(fi.final_residual.max()),
                final_predicted_seconds=c["final_predicted_seconds"], stages=model.auto_report.stages,
                notes=model.auto_report.notes), model


def probe(args: argparse.Namespace) -> None:
    import gpytorch

    from gpfalkon.auto import costs as auto_module

    data = _data(args.device, args.rows)
    x = data["xtr"]
    from gpfalkon.backend import KernelEngine

    kernel = gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[1]).to(x.device)
    rows = min(50_000, x.shape[0])
    engine = KernelEngine(kernel, x[:rows], x[:4000], store=False)
    u = torch.ones(4000, 1, dtype=torch.float64, device=x.device)
    passes = []
    with torch.no_grad():
        for _ in range(2):  # the first of the process pays the compilation
            _sync(args.device)
            t = time.perf_counter()
            engine.kmn_k(u)
            _sync(args.device)
            passes.append(time.perf_counter() - t)
    engine.release()
    probe_s = auto_module._onthefly_pass_seconds(kernel, x[:rows], x[:4000])
    out = dict(pass_seconds=passes, probe_seconds=probe_s, rows=rows, centers=4000, runs=[])
    print("on-the-fly pass seconds (cold, warm)", passes, "auto_fit's probe", probe_s, flush=True)
    for run in range(2):
        row, model = _auto_row(data, args.budget)
        out["runs"].append(row)
        print(json.dumps(row), flush=True)
        if run == 0:
            torch.save(dict(centers=model.centers.detach().cpu(), kernel_module=copy.deepcopy(model.kernel).cpu(),
                            kernel={k: v.cpu() for k, v in model.kernel.state_dict().items()},
                            noise=float(model.noise.detach()), rows=int(model.train_targets.shape[0])),
                       args.out / "final.pt")
    (args.out / "probe.json").write_text(json.dumps(out, indent=1))


def _saved_kernel(saved: dict, family: str, d: int):
    """The saved final model's kernel: the module itself where ``probe`` pickled it, else ``family`` rebuilt as
    auto_fit builds it (``KERNEL_FAMILIES``, lengthscales through ``exp``) with the saved state loaded."""
    from gpfalkon.auto.kernels import KERNEL_FAMILIES, _log_lengthscales

    if "kernel_module" in saved:
        return copy.deepcopy(saved["kernel_module"])
    kernel = KERNEL_FAMILIES[family](d)
    _log_lengthscales(kernel)
    kernel.load_state_dict(saved["kernel"])
    return kernel


def sums(args: argparse.Namespace) -> None:
    import gpfalkon.backend.engine as engine_mod
    from gpfalkon import FalkonGP, settings

    warnings.simplefilter("ignore")  # CG's advice at tol=0 and float32's floor: the residuals are reported
    saved = torch.load(args.final, weights_only=False)  # a file this script wrote (a pickled kernel module)
    data = _data(args.device, args.rows)
    n = min(args.fit_rows or saved["rows"], data["xtr"].shape[0])
    idx = torch.randperm(data["xtr"].shape[0], generator=torch.Generator().manual_seed(0))[:n].to(args.device)
    x = data["xtr"][idx]
    y = data["ytr"][idx].double() * data["y_scale"] + data["y_mean"]
    flush = engine_mod.FLUSH_ROWS
    variants = [("float32, each row sum over all rows in float32 (before)", torch.float32, False, 1 << 62),
                ("float32, row sums flushed to float64 every FLUSH_ROWS rows (now)", torch.float32, False, flush),
                ("float32 store, float64 products (wide_products)", torch.float32, True, flush),
                ("float64", torch.float64, True, flush)]
    rows = []
    try:
        for label, dtype, wide, flush_rows in variants:
            engine_mod.FLUSH_ROWS = flush_rows
            kernel = _saved_kernel(saved, args.kernel_family, x.shape[1]).to(device=args.device, dtype=dtype)
            with settings.wide_products(wide):
                model = FalkonGP(x.to(dtype), y.to(dtype), kernel=kernel,
                                 centers=saved["centers"].to(device=args.device, dtype=dtype),
                                 penalty=saved["noise"] / n, mean_constant=float(data["y_mean"]),
                                 max_iter=args.iterations, tol=0.0)
                _sync(args.device)
                t = time.perf_counter()
                model.fit()
                _sync(args.device)
                seconds = time.perf_counter() - t
            r = model.fit_info.residuals[:, 0]
            err, top = _test_error(model, data, dtype)
            row = dict(variant=label, n=n, M=int(saved["centers"].shape[0]), fit_s=seconds,
                       cg_s=model.fit_info.extra.get("cg_seconds"), iterations=model.fit_info.iterations,
                       res10=float(r[min(10, len(r) - 1)]), res20=float(r[min(20, len(r) - 1)]),
                       res_end=float(r[-1]), test_nrmse=err, max_abs_pred=top)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model
    finally:
        engine_mod.FLUSH_ROWS = flush
    out = dict(variants=rows)
    if not args.no_auto:
        out["auto"], _ = _auto_row(data, args.budget)
        print(json.dumps(out["auto"]), flush=True)
    (args.out / "sums.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["probe", "sums"])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--final", type=pathlib.Path, help="sums: the final model probe saved (final.pt)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=0, help="the first ROWS training and test rows (0: all)")
    p.add_argument("--budget", type=float, default=35.0)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--fit-rows", type=int, default=0, help="sums: random training rows of the refits (0: as many as "
                   "the saved model had)")
    p.add_argument("--no-auto", action="store_true")
    p.add_argument("--kernel-family", default="matern52",
                   help="sums: the family of a saved kernel state without its module (auto_fit's default)")
    args = p.parse_args()
    if args.part == "sums" and args.final is None:
        p.error("sums needs --final (the final.pt that probe writes)")
    args.out.mkdir(parents=True, exist_ok=True)
    (probe if args.part == "probe" else sums)(args)


if __name__ == "__main__":
    main()
