"""Row-sharded runs on torch.distributed (gloo on loopback, spawned processes) against one process.

Reference: the same model built in this process on all rows. Every sharded quantity - centers,
alpha, predictive mean and variance, every exact objective's value and gradients, the
parameters after three Adam steps - must equal it to 1e-10 (float64), on every rank, with
uneven shards and with an empty shard.
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

import gpfalkon
from gpfalkon import DistributedError, FalkonClassifier, FalkonGP, FalkonOptions

sys.path.insert(0, os.path.dirname(__file__))
import _distributed_workers as W

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def reference():
    return {outputs: W.single_process_results(outputs) for outputs in (1, 2)}


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _load(out_dir, world):
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


@pytest.mark.parametrize("sizes,outputs", [((100, 140), 1), ((100, 0, 140), 1), ((30, 210), 2)],
                         ids=["2-ranks", "3-ranks-one-empty", "2-ranks-2-outputs"])
def test_sharded_model_equals_single_process(tmp_path, reference, sizes, outputs):
    W.run(len(sizes), W._fit_and_save, (list(sizes), str(tmp_path), outputs), str(tmp_path))
    ref = reference[outputs]
    ranks = _load(tmp_path, len(sizes))
    for r, res in enumerate(ranks):
        assert res["n"] == W.N
        assert torch.equal(res["centers"], ref["centers"]), f"rank {r}: centers differ"
        for key in ("alpha", "mean", "var"):
            _close(res[key], ref[key], f"rank {r} {key}")
        for name in W.COMPARED:
            _close(res[f"{name}/value"], ref[f"{name}/value"], f"rank {r} {name} value")
            assert set(res[f"{name}/grads"]) == set(ref[f"{name}/grads"]), f"rank {r} {name}: gradient keys"
            assert "centers" in ref[f"{name}/grads"] and "kernel.base_kernel.raw_lengthscale" in ref[f"{name}/grads"]
            for p, g in ref[f"{name}/grads"].items():
                _close(res[f"{name}/grads"][p], g, f"rank {r} {name} d/d{p}")
        for p, v in ref["after_adam"].items():
            _close(res["after_adam"][p], v, f"rank {r} {p} after 3 Adam steps")
            # bitwise identical on every rank: the ranks cannot drift apart
            assert torch.equal(res["after_adam"][p], ranks[0]["after_adam"][p]), f"rank {r} {p} differs from rank 0"


def test_rank0_state_dict_loads_in_one_process(tmp_path):
    W.run(2, W._fit_and_save, ([120, 120], str(tmp_path), 1), str(tmp_path))
    sd = _load(tmp_path, 1)[0]["state_dict"]
    x, y, xt = W.data()
    model = W.build(x, y, learn_centers=True)  # a single-process model on all rows
    model.load_state_dict(sd)
    assert bool(model.fitted)  # the data fingerprint (global sums) matches the full data
    model.eval()
    with torch.no_grad():
        pred = model(xt)
    ref = W.build(x, y, learn_centers=True)
    ref.load_state_dict({k: v for k, v in sd.items() if k not in ("alpha", "fitted", "data_fingerprint")},
                        strict=False)
    ref.fit()
    ref.eval()
    with torch.no_grad():
        want = ref(xt)
    _close(pred.mean, want.mean, "mean from the loaded state")
    _close(pred.variance, want.variance, "variance from the loaded state")


def test_sharded_classifier_codes_labels_globally(tmp_path):
    x, labels, xt = W.class_data()
    order = torch.argsort(labels, stable=True)  # rank 0 holds only the first class's rows
    assert int((labels == labels.min()).sum()) >= 40
    perm_x, perm_l = x[order], labels[order]
    # the worker uses the data in its own order: give it the sorted data through the shard sizes
    ref = FalkonClassifier(perm_x, perm_l, W.make_kernel(), num_centers=W.M, penalty=1e-3, seed=3, tol=1e-12,
                           max_iter=500).fit()
    W.run(2, _sorted_classifier, ([40, W.N - 40], str(tmp_path)), str(tmp_path))
    for r, res in enumerate(_load(tmp_path, 2)):
        assert torch.equal(res["classes"], ref.classes), f"rank {r}: classes"
        _close(res["alpha"], ref.model.alpha, f"rank {r} alpha")
        _close(res["scores"], ref.decision_function(xt), f"rank {r} scores")


def _sorted_classifier(rank, world, sizes, out_dir):
    import _distributed_workers as W2

    x, labels, xt = W2.class_data()
    order = torch.argsort(labels, stable=True)
    W2.class_data = lambda: (x[order], labels[order], xt)
    W2._classifier_and_save(rank, world, sizes, out_dir)


@pytest.mark.parametrize("what,named", [("kernel", "kernel_hyperparameters"), ("d", "data_shape"),
                                        ("seed", "center_indices"), ("num_centers", "num_centers"),
                                        ("max_iter", "solver_settings"), ("learn_centers", "solver_settings"),
                                        ("initial_alpha", "cg_start"), ("initial_alpha_one_rank", "cg_start"),
                                        ("store_format", "store_format"), ("nu", "kernel_structure"),
                                        ("mean_constant", "mean_constant"), ("fit_tol", "fit_rules"),
                                        ("solve_method", "fit_rules"), ("settings_tol", "fit_rules"),
                                        ("nu_after", "kernel_structure"), ("nan", None), ("source_rewritten", None),
                                        ("objective_sgpr", "kernel_hyperparameters"),
                                        ("objective_gcv", "kernel_hyperparameters")])
def test_ranks_that_disagree_are_told_so(tmp_path, what, named):
    W.run(2, W._inconsistent, (str(tmp_path), what), str(tmp_path))
    results = _load(tmp_path, 2)
    if named is None:  # NaN rows on rank 1 (at construction), or its row source's file rewritten before fit(): its
        # own error there, and rank 0 told so at once (not left waiting for the process group's timeout)
        own = "changed since the source was opened" if what == "source_rewritten" else "train_x contains 1 NaN or Inf"
        assert own in results[1]["message"], results[1]["message"]
        assert "another rank's train_x / train_y failed the input checks" in results[0]["message"], results[0]
        return
    for res in results:
        assert f"ranks disagree on {named}" in res["message"], res["message"]


def test_a_cg_start_is_shared_checked_and_equals_one_process(tmp_path):
    """fit(initial_alpha=...) with rows on two ranks: the same start on both gives the single-process fit from
    that start (alpha and CG's residual history, 7 iterations); an invalid start on one rank raises on both
    (the other rank is told, instead of waiting in a collective)."""
    x, y, _ = W.data()
    ref = FalkonGP(x, y, W.make_kernel(), num_centers=W.M, seed=3, penalty=1e-4, max_iter=7, tol=0.0,
                   options=FalkonOptions(solve_method="cg"))
    ref.fit(initial_alpha=W.start_of(ref))
    assert float(ref.fit_info.residuals[0].max()) < 1.0  # the start was used
    W.run(2, W._started, (str(tmp_path), "same"), str(tmp_path))
    for r, res in enumerate(_load(tmp_path, 2)):
        assert res["message"] == "no error", res["message"]
        _close(res["alpha"], ref.alpha, f"rank {r} alpha")
        _close(res["residuals"], ref.fit_info.residuals, f"rank {r} residuals")
    W.run(2, W._started, (str(tmp_path), "invalid"), str(tmp_path))
    msgs = [res["message"] for res in _load(tmp_path, 2)]
    assert "another rank passed an invalid callback or initial_alpha" in msgs[0], msgs
    assert "initial_alpha must be floating point and finite" in msgs[1], msgs


def test_a_fixed_point_store_on_two_ranks_equals_one_process(tmp_path):
    """store_format("int16") rounds each row of K_nM by its own scale, so two ranks' shards store the rows one
    process stores: the same alpha and CG residual history (7 iterations from one start)."""
    x, y, _ = W.data()
    ref = FalkonGP(x, y, W.make_kernel(), num_centers=W.M, seed=3, penalty=1e-4, max_iter=7, tol=0.0,
                   options=FalkonOptions(solve_method="cg"))
    with gpfalkon.settings.store_format("int16"):
        ref.fit(initial_alpha=W.start_of(ref))
    plain = FalkonGP(x, y, W.make_kernel(), num_centers=W.M, seed=3, penalty=1e-4, max_iter=7, tol=0.0,
                     options=FalkonOptions(solve_method="cg"))
    plain.fit(initial_alpha=W.start_of(plain))
    assert not torch.allclose(ref.alpha, plain.alpha, rtol=1e-9, atol=0)  # the rounding shows
    W.run(2, W._started, (str(tmp_path), "int16"), str(tmp_path))
    for r, res in enumerate(_load(tmp_path, 2)):
        assert res["message"] == "no error", res["message"]
        _close(res["alpha"], ref.alpha, f"rank {r} alpha")
        _close(res["residuals"], ref.fit_info.residuals, f"rank {r} residuals")


def test_approximate_variances_on_one_rank_need_no_collective_and_equal_one_process(tmp_path):
    """settings.variance_factors("approximate") forms the factors from K_MM, n and the penalty: rank 0 alone asks
    for variances (rank 1 waits in the final barrier, no hang) and gets the single process's."""
    x, y, xt = W.data()
    ref = FalkonGP(x, y, W.make_kernel(), num_centers=W.M, seed=3, penalty=1e-4).fit()
    ref.eval()
    with torch.no_grad(), gpfalkon.settings.variance_factors("approximate"):
        want = ref(xt).variance
    W.run(2, W._approximate_variances, (str(tmp_path),), str(tmp_path))
    res = torch.load(os.path.join(tmp_path, "rank0.pt"), weights_only=False)
    _close(res["alpha"], ref.alpha, "rank 0 alpha")
    _close(res["var"], want, "rank 0 approximate variances")


def test_a_dead_rank_makes_the_others_raise(tmp_path):
    codes = W.run(2, W._killed, (str(tmp_path),), str(tmp_path), timeout_s=20.0, deadline_s=120.0, allow_exit=(1,),
              final_barrier=False)
    assert codes[1] == 3
    res = _load(tmp_path, 1)[0]
    assert res["type"] == DistributedError.__name__, res["message"]
    assert "another rank died" in res["message"]
    assert res["seconds"] < 60.0


def test_backend_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        gpfalkon.DistributedBackend()


def test_default_backend_serves_cpu_and_cuda_tensors(monkeypatch):
    """Where CUDA is available the default group has gloo for CPU tensors beside NCCL (a plain NCCL
    group cannot reduce the CPU tensors of host-resident rows); elsewhere gloo."""
    from gpfalkon.backend.distributed import default_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert default_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert default_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"


def test_init_distributed_validates_timeout():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        gpfalkon.init_distributed("gloo", timeout_s=0)


def test_single_process_defaults_unchanged():
    """Without a sharded backend nothing of the sharded machinery runs: n is the local row count."""
    x, y, _ = W.data()
    model = FalkonGP(x, y, num_centers=10)
    assert model.n == x.shape[0]
    with pytest.raises(ValueError, match="train_x is empty"):
        FalkonGP(x[:0], y[:0], num_centers=1)


def test_state_dict_of_a_stale_fit_loads_unfitted():
    """A fit made stale by a later hyperparameter change is saved as unfitted (single process)."""
    x, y, xt = W.data()
    model = W.build(x, y).fit()
    assert bool(model.state_dict()["fitted"])
    with torch.no_grad():
        model.kernel.outputscale = model.kernel.outputscale * 2
    sd = model.state_dict()
    assert not bool(sd["fitted"])
    fresh = W.build(x, y)
    fresh.load_state_dict(sd)
    assert not bool(fresh.fitted)
    fresh.eval()
    with pytest.raises(gpfalkon.NotFittedError, match="call fit"):
        fresh(xt)


def _two_node_torchrun(torchrun: str, root: str, log_dir: pathlib.Path, deadline_s: float = 240.0,
                       grace_s: float = 30.0) -> tuple[list[str], list[int | None], bool]:
    """Start ``examples/distributed_fit.py`` under two ``torchrun --nnodes 2`` launchers on a fresh port
    and wait for both: ``(outputs, return codes, timed out)``. Where one launcher fails, the other gets
    ``grace_s`` to end (a launcher whose peer is gone can wait for it indefinitely), then both process
    groups are killed; at ``deadline_s`` too."""
    import signal
    import subprocess
    import time

    port = W.free_port()
    cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"gpfalkon-test-{port}", "--max-restarts", "0",
           os.path.join(root, "examples", "distributed_fit.py"), "--centers", "200", "--rows", "3000",
           "--tol", "1e-12", "--iterations", "1000", "--learn", "1", "--check", "--timeout", "60"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [log_dir / f"node{i}-{port}.log" for i in range(2)]
    handles = [open(f, "w") for f in logs]  # files, not pipes: nothing blocks on a full pipe
    nodes = [subprocess.Popen(cmd, stdout=h, stderr=subprocess.STDOUT, text=True, env=env, cwd=root,
                              start_new_session=True)  # own process group: a kill reaches the workers too
             for h in handles]
    t_end = time.monotonic() + deadline_s
    timed_out = False
    try:
        # poll every launcher on each pass (a generator in any() would stop at the first still running one,
        # leave a failed second launcher unpolled, and so never start its peer's grace period)
        while any([p.poll() is None for p in nodes]):
            if any(p.returncode not in (None, 0) for p in nodes):
                t_end = min(t_end, time.monotonic() + grace_s)
            if time.monotonic() > t_end:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for h in handles:
            h.close()
    return [f.read_text() for f in logs], [p.returncode for p in nodes], timed_out


def test_two_node_torchrun_on_loopback_fits_the_single_process_alpha(tmp_path):
    """``examples/distributed_fit.py`` under two ``torchrun --nnodes 2`` launchers (one process each)
    that meet through a c10d rendezvous on localhost: the two-"node" alpha equals one process's.

    torch 2.13 occasionally aborts a worker at exit, after the example's last barrier and
    ``destroy_process_group`` ("terminate called without an active exception", in a fresh-clone CI
    run on 2026-11-26, after the check had passed; twice in a row in the fresh-clone CI run of
    2026-11-27 07:24, then 7 of 7 runs of this test alone passed), and the other launcher then waits for its
    gone peer. That run is repeated (a fresh rendezvous) up to twice; any other failure, or the same one three
    times, fails the test."""
    import re
    import shutil

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    attempts = 3
    for attempt in range(attempts):
        outs, codes, timed_out = _two_node_torchrun(torchrun, root, tmp_path)
        text = "\n----\n".join(outs)
        teardown_abort = ("terminate called without an active exception" in text
                          and "max |alpha - single-process alpha|" in text)
        if (timed_out or any(c != 0 for c in codes)) and teardown_abort and attempt < attempts - 1:
            continue
        break
    if timed_out:  # show what each launcher printed, not just "timed out"
        pytest.fail("torchrun launchers did not finish in time; their output:\n" + text)
    assert all(c == 0 for c in codes), text
    assert "2 ranks, rows per rank [1500, 1500]" in text, text
    m = re.search(r"max \|alpha - single-process alpha\| = ([0-9.e+-]+) \(max \|alpha\| ([0-9.e+-]+)\)", text)
    assert m is not None, text
    assert float(m.group(1)) <= 1e-9 * float(m.group(2)), text


def test_auto_solve_method_is_one_choice_across_ranks(tmp_path):
    """One rank's shard fits the memory budget (K_nM stored), the other's does not. At this size
    the cost model picks CG for a stored K_nM and the direct solve for one recomputed on the fly
    (checked below on one process): every rank must still run the same solve (else their
    collectives would not match), with the single-process alpha."""
    from gpfalkon.solvers import choose_method

    sizes, m = (400, 1600), 400
    budget = 1000 * m * 8  # 400 rows fit, 1,600 do not
    n = sum(sizes)
    assert choose_method(n, m, W.D, itemsize=8, stored=True, tol=1e-8, max_iter=1000) == "cg"
    assert choose_method(n, m, W.D, itemsize=8, stored=False, tol=1e-8, max_iter=1000) == "direct"
    W.run(2, W._mixed_storage, (list(sizes), m, budget, str(tmp_path)), str(tmp_path))
    ranks = _load(tmp_path, 2)
    assert [r["stored"] for r in ranks] == [True, False]
    assert ranks[0]["method"] == ranks[1]["method"] == "direct"
    x, y, _ = W.data(n=n)
    ref = FalkonGP(x, y, W.make_kernel(), num_centers=m, seed=3, penalty=1e-3,
                   options=FalkonOptions(solve_method="direct")).fit()
    for r, res in enumerate(ranks):
        torch.testing.assert_close(res["alpha"], ref.alpha, rtol=1e-6, atol=1e-8, msg=lambda s, r=r: f"rank {r}: {s}")


def test_float32_direct_solve_sums_its_float64_passes_over_ranks(tmp_path):
    """float32 shards (one empty) solved directly: every rank's alpha is the single-process float32 direct fit's,
    itself the float64 fit's to ~1e-7 of the prediction scale."""
    sizes = (150, 0, 250)
    W.run(3, W._float32_direct, (list(sizes), str(tmp_path)), str(tmp_path))
    ranks = _load(tmp_path, 3)
    x, y, xt = W.data(n=sum(sizes), dtype=torch.float32)
    fits = [FalkonGP(x.to(dt), y.to(dt), W.make_kernel(dtype=dt), centers=x[:60].to(dt), penalty=1e-6,
                     options=FalkonOptions(solve_method="direct")).fit() for dt in (torch.float32, torch.float64)]
    kt = fits[1].kernel(xt.double(), x[:60].double()).to_dense().detach()
    want = kt @ fits[1].alpha.reshape(-1)
    for r, res in enumerate(ranks):
        assert res["method"] == "direct"
        torch.testing.assert_close(res["alpha"], fits[0].alpha, rtol=1e-6, atol=1e-6 * float(fits[0].alpha.abs().max()),
                                   msg=lambda s, r=r: f"rank {r}: {s}")
        got = kt @ res["alpha"].reshape(-1)
        assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max()), (r, float((got - want).abs().max()))


def test_a_rank_whose_arithmetic_rounds_differently_follows_rank_0s_iteration(tmp_path):
    """Rank 1's preconditioner products differ from rank 0's in the ninth digit: CG's M-sized iteration runs on
    rank 0 alone (``DistributedBackend.lead_solve``), so both ranks return rank 0's solution bit for bit, after
    the same iterations, and it is the single-process fit's (each rank iterating itself, their vectors drift apart
    and a rank could stop alone, leaving the other in the next product's collective)."""
    W.run(2, W._heterogeneous, (str(tmp_path),), str(tmp_path))
    ranks = _load(tmp_path, 2)
    assert torch.equal(ranks[0]["alpha"], ranks[1]["alpha"]) and ranks[0]["iterations"] == ranks[1]["iterations"]
    x, y, _ = W.data(n=300)
    ref = FalkonGP(x, y, W.make_kernel(), centers=x[:40].clone(), penalty=1e-6, tol=1e-10, max_iter=400,
                   options=FalkonOptions(solve_method="cg")).fit()
    torch.testing.assert_close(ranks[0]["alpha"], ref.alpha, rtol=1e-6, atol=1e-6 * float(ref.alpha.abs().max()))


def test_lead_solve_serves_rank_0s_products_and_passes_on_its_result_or_error(tmp_path):
    """Three ranks: the followers run every product rank 0 announces (same inputs, summed collectively: 1 + 2 + 3
    times the vector), receive rank 0's solution and record, and raise rank 0's FalkonConvergenceError with its
    message (the jitter boost's retry depends on it)."""
    W.run(3, W._lead_solve_protocol, (str(tmp_path),), str(tmp_path))
    ranks = _load(tmp_path, 3)
    for r, res in enumerate(ranks):
        assert res["seen"] == [1.0, 2.0, 3.0, 1.0], (r, res["seen"])
        assert torch.equal(res["sol"], torch.full((4, 2), 18.0, dtype=torch.float64)), r
        assert res["info"] == {"products": 3, "sums": [6.0, 12.0, 18.0]}, r
        assert res["error"] == "CG lost positive definiteness at iteration 1 (test)", r


def test_fixed_store_jitter_is_the_same_on_a_rank_storing_nothing(tmp_path):
    """int16 store, rank 1's shard empty: both ranks precondition at the store's resolution and solve one system,
    the single-process fit's."""
    from gpfalkon import settings

    W.run(2, W._fixed_store_empty_shard, (str(tmp_path),), str(tmp_path))
    ranks = _load(tmp_path, 2)
    assert ranks[0]["jitter"] is not None and ranks[0]["jitter"] == ranks[1]["jitter"]
    x, y, _ = W.data(n=400)
    with settings.store_format("int16"):
        ref = FalkonGP(x, y, W.make_kernel(), centers=x[:40].clone(), penalty=1e-6, tol=1e-9, max_iter=300,
                       options=FalkonOptions(solve_method="cg", store_kernel=True)).fit()
    for r, res in enumerate(ranks):
        torch.testing.assert_close(res["alpha"], ref.alpha, rtol=1e-6, atol=1e-8, msg=lambda s, r=r: f"rank {r}: {s}")


def test_sharded_file_source_equals_single_process(tmp_path):
    """Two ranks each read their shard of one .npy file (NpyRows + shard_rows)."""
    import numpy as np

    x, y, xt = W.data()
    path = tmp_path / "x.npy"
    np.save(path, x.numpy())
    ref = W.build(x, y, learn_centers=False).fit()
    ref.eval()
    with torch.no_grad():
        want = ref(xt)
    W.run(2, W._source_and_save, (str(path), str(tmp_path)), str(tmp_path))
    for r, res in enumerate(_load(tmp_path, 2)):
        _close(res["alpha"], ref.alpha, f"rank {r} alpha")
        _close(res["mean"], want.mean, f"rank {r} mean")
        _close(res["var"], want.variance, f"rank {r} variance")


@pytest.mark.parametrize("sizes,repeated", [((100, 140), False), ((90, 0, 150), False), ((100, 140), True)],
                         ids=["2-ranks", "3-ranks-one-empty", "2-ranks-repeated-rows"])
def test_leverage_centers_do_not_depend_on_the_sharding(tmp_path, sizes, repeated):
    """BLESS scores and the leverage draws made over the global rows: the same centers, weights
    and alpha as one process, given one seed; with repeated rows, drawn rows of one value merged alike."""
    x, y = W.repeated_data() if repeated else W.data()[:2]
    ref = W.leverage_model(x, y).fit()
    assert ref.center_weights is not None and ref.centers.shape[0] < W.M  # some centers drawn twice: weights matter
    if repeated:
        assert torch.unique(ref.centers, dim=0).shape[0] == ref.centers.shape[0]
        apart = gpfalkon.leverage_centers(x, W.M, W.make_kernel(), 1e-3, distinct=False,
                                          generator=torch.Generator().manual_seed(5), min_dictionary_size=16)
        assert torch.unique(apart.centers, dim=0).shape[0] < apart.centers.shape[0]  # merging happened
    W.run(len(sizes), W._leverage_and_save, (list(sizes), str(tmp_path), repeated), str(tmp_path))
    for r, res in enumerate(_load(tmp_path, len(sizes))):
        assert torch.equal(res["centers"], ref.centers), f"rank {r}: centers"
        _close(res["weights"], ref.center_weights, f"rank {r} weights")
        _close(res["alpha"], ref.alpha, f"rank {r} alpha")


@pytest.mark.parametrize("sizes", [(100, 140), (90, 0, 150)], ids=["2-ranks", "3-ranks-one-empty"])
def test_distinct_uniform_centers_do_not_depend_on_the_sharding(tmp_path, sizes):
    """Uniform centers on data with repeated rows: the draws skip repeats over the global rows (gathered in
    doublings), so every rank gets one process's centers."""
    x, _ = W.repeated_data()
    ref = gpfalkon.uniform_centers(x, W.M, torch.Generator().manual_seed(3))
    plain = gpfalkon.uniform_centers(x, W.M, torch.Generator().manual_seed(3), distinct=False)
    assert torch.unique(plain.centers, dim=0).shape[0] < W.M  # the data repeat rows: a plain draw repeats centers
    assert torch.unique(ref.centers, dim=0).shape[0] == W.M
    W.run(len(sizes), W._distinct_centers_and_save, (list(sizes), str(tmp_path)), str(tmp_path))
    for r, res in enumerate(_load(tmp_path, len(sizes))):
        assert torch.equal(res["indices"], ref.indices), f"rank {r}: indices"
        assert torch.equal(res["centers"], ref.centers), f"rank {r}: centers"
