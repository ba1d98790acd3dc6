"""Exact objectives against naive dense formulas (n x n matrices, pseudo-inverses)."""
from __future__ import annotations

import copy
import math

import gpytorch
import pytest
import torch

from gpfalkon import FalkonGP, settings
from gpfalkon.backend.passes import uses_gram_route, whitened_aggregates
from gpfalkon.objectives import GCV, LOOCV, CompReg, HoldOut, NystromCompReg, SGPRBound

from conftest import dense_kernel, make_data, make_kernel


def _model(t=None, n=120, m=12, lam=1e-3, learn_centers=True, dtype=torch.float64):
    x, y = make_data(n, 2, t=t, dtype=dtype)
    k = make_kernel("scale_matern52", 2, dtype=dtype)
    k.base_kernel.lengthscale = k.base_kernel.lengthscale * 0.6  # well-conditioned K_MM
    return FalkonGP(x, y, kernel=k, num_centers=m, penalty=lam, learn_centers=learn_centers)


def _smoother(model, v):
    x, c, k = model.train_inputs[0], model.centers, model.kernel
    knm, kmm = dense_kernel(k, x, c), dense_kernel(k, c, c)
    kt = knm @ torch.linalg.pinv(kmm) @ knm.T
    n = x.shape[0]
    S = kt @ torch.linalg.inv(kt + v * torch.eye(n, dtype=x.dtype))
    return S, kt, dense_kernel(k, x, x)


def naive(name, model, objective=None):
    x = model.train_inputs[0]
    y = model.train_targets
    y = y.unsqueeze(-1) if y.dim() == 1 else y
    n, lam = x.shape[0], model.penalty
    eye = torch.eye(n, dtype=x.dtype)
    total = 0.0
    if name in ("GCV", "LOOCV"):
        S, kt, knn = _smoother(model, (n - 1) * lam)
    elif name != "HoldOut":
        S, kt, knn = _smoother(model, n * lam)
    for j in range(y.shape[1]):
        yj = y[:, j]
        if name == "CompReg":
            total = total + S.trace() + yj @ (eye - S) @ yj
        elif name == "NystromCompReg":
            fit = yj @ (eye - S) @ yj
            total = total + S.trace() + fit + (knn.trace() - kt.trace()) / (n * lam) * fit / n
        elif name == "GCV":
            r = (eye - S) @ yj
            total = total + (r @ r / n) / (1 - S.trace() / n) ** 2
        elif name == "LOOCV":
            r = (eye - S) @ yj
            total = total + ((r / (1 - S.diagonal())) ** 2).mean()
        elif name == "SGPRBound":
            v = n * lam
            C = kt + v * eye
            total = total + 0.5 * (torch.logdet(C) + yj @ torch.linalg.solve(C, yj) + (knn.trace() - kt.trace()) / v)
            total = total + 0.5 * n * math.log(2 * math.pi)
    if name == "HoldOut":
        tr, va = objective.split()
        c, k = model.centers, model.kernel
        ktr = dense_kernel(k, x[tr], c)
        kmm = dense_kernel(k, c, c)
        alpha = torch.linalg.solve(ktr.T @ ktr + len(tr) * lam * kmm, ktr.T @ y[tr])
        total = ((dense_kernel(k, x[va], c) @ alpha - y[va]) ** 2).mean()
    return total


OBJECTIVES = {"CompReg": CompReg, "NystromCompReg": NystromCompReg, "GCV": GCV, "LOOCV": LOOCV,
              "HoldOut": HoldOut, "SGPRBound": SGPRBound}


@pytest.mark.parametrize("route", ["auto", "gram"])
@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("t", [None, 2])
def test_value_and_gradients_match_naive_dense(name, t, route):
    model = _model(t=t)
    obj = OBJECTIVES[name](model, block_rows=37)
    params = [model.kernel.base_kernel.raw_lengthscale, model.kernel.raw_outputscale,
              model.likelihood.raw_noise, model.centers]
    with settings.aggregate_route(route):  # float64 data: "auto" is the solve route
        ours = obj()
        g_ours = torch.autograd.grad(ours, params)
    ref = naive(name, model, obj)
    g_ref = torch.autograd.grad(ref, params)
    torch.testing.assert_close(ours, ref, rtol=1e-8, atol=1e-10)
    for a, b in zip(g_ours, g_ref, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("t", [None, 2])
@pytest.mark.parametrize("m", [12, 120])
def test_loocv_residuals_are_those_of_explicit_leave_one_out_refits(t, m):
    """Each residual is that of the Nystrom KRR refitted without its row (the centers kept, noise
    ``v = (n - 1) lambda``): ``n`` dense solves; ``S_ii`` is the dense smoother's diagonal, and the objective the
    residuals' mean square (``m = n``: every row a center, exact kernel ridge regression)."""
    model = _model(t=t, m=m, learn_centers=False)
    obj = LOOCV(model, block_rows=37)
    r, s_ii = obj.residuals()
    x, c, k = model.train_inputs[0], model.centers, model.kernel
    y = model.train_targets
    y = y.unsqueeze(-1) if y.dim() == 1 else y
    n = x.shape[0]
    v = float((n - 1) * model.penalty.detach())
    with torch.no_grad():
        knm, kmm = dense_kernel(k, x, c), dense_kernel(k, c, c)
        ref = torch.empty_like(y)
        for i in range(n):
            keep = torch.arange(n) != i
            a = knm[keep]
            alpha = torch.linalg.solve(a.T @ a + v * kmm, a.T @ y[keep])
            ref[i] = y[i] - knm[i] @ alpha
        S, _, _ = _smoother(model, (n - 1) * model.penalty.detach())
    assert r.shape == y.shape and s_ii.shape == (n,) and not r.requires_grad
    torch.testing.assert_close(r, ref, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(s_ii, S.diagonal(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(r.square().mean(0).sum(), obj().detach(), rtol=1e-10, atol=0)


@pytest.mark.parametrize("name", ["NystromCompReg", "LOOCV", "SGPRBound"])
def test_gradients_match_finite_differences(name):
    model = _model(n=40, m=5)
    obj = OBJECTIVES[name](model, block_rows=16)
    ls, noise, c = model.kernel.base_kernel.raw_lengthscale, model.likelihood.raw_noise, model.centers

    # finite differences of the objective against its autograd gradient, per parameter
    base = obj()
    grads = torch.autograd.grad(base, [ls, noise, c])
    for p, g in zip([ls, noise, c], grads, strict=False):
        d = torch.randn_like(p)
        eps = 1e-6
        with torch.no_grad():
            p.add_(eps * d)
        up = obj().detach()
        with torch.no_grad():
            p.sub_(2 * eps * d)
        down = obj().detach()
        with torch.no_grad():
            p.add_(eps * d)
        fd = (up - down) / (2 * eps)
        torch.testing.assert_close(fd, (g * d).sum(), rtol=1e-5, atol=1e-7)


def test_sgpr_bound_equals_gpytorch_sgpr_loss():
    model = _model(learn_centers=False)
    x, y = model.train_inputs[0], model.train_targets
    n = x.shape[0]

    class SGPR(gpytorch.models.ExactGP):
        def __init__(self, lik):
            super().__init__(x, y, lik)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.InducingPointKernel(
                model.kernel, inducing_points=model.centers.clone(), likelihood=lik
            )

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(z), self.covar_module(z))

    lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.Positive()).double()
    lik.noise = model.noise.detach()
    sgpr = SGPR(lik).double()
    sgpr.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, sgpr)
    with gpytorch.settings.max_cholesky_size(10**9):
        loss = -mll(sgpr(x), y)
    ours = SGPRBound(model)()
    torch.testing.assert_close(ours / n, loss, rtol=1e-8, atol=1e-10)


def test_holdout_split_is_reproducible_and_validated():
    model = _model()
    a = HoldOut(model, val_fraction=0.3, generator=torch.Generator().manual_seed(5))
    b = HoldOut(model, val_fraction=0.3, generator=torch.Generator().manual_seed(5))
    assert all(torch.equal(p, q) for p, q in zip(a.split(), b.split(), strict=False))
    assert len(a.split()[1]) == 36
    torch.testing.assert_close(a(), b())
    r = HoldOut(model, redraw=True)
    first = r.split()[1].clone()
    assert not torch.equal(first, r.split()[1])
    with pytest.raises(ValueError, match="val_fraction"):
        HoldOut(model, val_fraction=1.0)
    with pytest.raises(ValueError, match="block_rows"):
        GCV(model, block_rows=0)


def test_objectives_train_in_a_gpytorch_loop():
    """Adam on NystromCompReg lowers it and the fitted model then predicts."""
    model = _model(n=200, m=15)
    obj = NystromCompReg(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    start = obj().item()
    for _ in range(30):
        opt.zero_grad()
        loss = obj()
        loss.backward()
        opt.step()
    assert obj().item() < start
    # the same loop through the helper keeps lowering it
    values = obj.minimize(10, lr=0.05)
    assert len(values) == 10 and values[-1] < values[0] < start
    with pytest.raises(ValueError, match="steps"):
        obj.minimize(-1)
    model.fit()
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(model.train_inputs[0][:5]).mean).all()


def test_minimize_takes_a_closure_optimizer_and_matches_the_hand_written_loop():
    """``minimize(optimizer=LBFGS)`` (an optimiser that evaluates the objective several times a step) takes
    the same steps as torch's closure loop written by hand, from the same start."""
    model = _model(n=200, m=15, learn_centers=False)
    twin = copy.deepcopy(model)
    obj = GCV(model)
    values = obj.minimize(3, optimizer=torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5))
    assert len(values) == 3 and values[-1] < values[0]
    ref = GCV(twin)
    opt = torch.optim.LBFGS(twin.parameters(), lr=0.1, max_iter=5)

    def closure():
        opt.zero_grad()
        loss = ref()
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_minimize_restores_the_parameters_when_a_step_leaves_the_finite_region():
    """A line-search evaluation that overflows (LBFGS with an absurd step) restores the parameters to their
    values before that step, naming it."""
    model = _model(n=150, m=12, learn_centers=False)
    before = [p.detach().clone() for p in model.parameters()]
    obj = GCV(model)
    with pytest.raises(ValueError, match="restored"):
        obj.minimize(2, optimizer=torch.optim.LBFGS(model.parameters(), lr=1e12, max_iter=3))
    after = list(model.parameters())
    assert all(bool(torch.isfinite(p).all()) for p in after)
    assert any(torch.equal(a.detach(), b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("name", ["SGPRBound", "GCV", "HoldOut", "LOOCV"])
def test_float32_data_with_a_float64_kernel_gives_the_objectives_in_the_datas_dtype(name):
    """GPyTorch promotes float32 points against float64 parameters to float64 kernel blocks: the objectives
    still evaluate (they multiplied a float64 block by the float32 targets), within float32 rounding of the
    float64 model's values, with gradients for the kernel's parameters."""
    model = _model(n=150, m=12, learn_centers=False)
    x, y = model.train_inputs[0], model.train_targets
    mixed = FalkonGP(x.float(), y.float(), kernel=copy.deepcopy(model.kernel), centers=model.centers.detach().float(),
                     penalty=float(model.penalty.detach()))
    value = OBJECTIVES[name](mixed)()
    assert value.dtype == torch.float32 or value.dtype == torch.float64
    torch.testing.assert_close(value.double(), OBJECTIVES[name](model)().detach(), rtol=2e-3, atol=2e-3)
    (grad,) = torch.autograd.grad(value, mixed.kernel.base_kernel.raw_lengthscale)
    assert bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0)


from gpfalkon.objectives import StochasticNystromCompReg  # noqa: E402

GRAD_PARAMS = lambda m: [m.kernel.base_kernel.raw_lengthscale, m.kernel.raw_outputscale,
                         m.likelihood.raw_noise, m.centers]


@pytest.mark.parametrize("ktilde_trace", ["subsample", "hutchinson"])
def test_stochastic_is_exact_with_identity_trace_vectors(ktilde_trace):
    """Z Z^T / r = I (Z = sqrt(n) I), all rows in the subset, CG converged: the value and
    the hand-derived gradients equal the exact objective and its autograd gradients."""
    model = _model(n=60, m=8, t=None)
    n = 60
    z = n**0.5 * torch.eye(n, dtype=torch.float64)
    sto = StochasticNystromCompReg(model, trace_vectors=z, cg_iterations=2000, cg_tol=1e-13,
                                   ktilde_trace=ktilde_trace, subsample_size=n, block_rows=17)
    exact = NystromCompReg(model)
    params = GRAD_PARAMS(model)
    v_s = sto()
    g_s = torch.autograd.grad(v_s, params)
    v_e = exact()
    g_e = torch.autograd.grad(v_e, params)
    torch.testing.assert_close(v_s, v_e, rtol=1e-8, atol=1e-8)
    for a, b in zip(g_s, g_e, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_stochastic_error_shrinks_with_more_trace_vectors():
    model = _model(n=300, m=20)
    exact = NystromCompReg(model)
    params = GRAD_PARAMS(model)
    v_e = exact()
    g_e = torch.cat([g.flatten() for g in torch.autograd.grad(v_e, params)])
    errs, gerrs = [], []
    for r in (2, 16, 128):
        e, ge = 0.0, 0.0
        for seed in range(4):
            sto = StochasticNystromCompReg(model, num_trace_vectors=r, generator=torch.Generator().manual_seed(seed),
                                           cg_iterations=500, cg_tol=1e-12, subsample_size=300)
            v = sto()
            g = torch.cat([gg.flatten() for gg in torch.autograd.grad(v, params)])
            e += abs(float(v - v_e)) / 4
            ge += float((g - g_e).norm() / g_e.norm()) / 4
        errs.append(e)
        gerrs.append(ge)
    assert errs[2] < errs[1] < errs[0], errs
    assert gerrs[2] < gerrs[0], gerrs


def test_stochastic_warm_start_and_training_loop():
    model = _model(n=400, m=20)
    sto = StochasticNystromCompReg(model, num_trace_vectors=20, cg_iterations=10)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    exact = NystromCompReg(model)
    start = exact().item()
    for _ in range(25):
        opt.zero_grad()
        loss = sto()
        loss.backward()
        opt.step()
    assert sto.last_info.iterations == 10 and sto._alpha is not None
    assert exact().item() < start
    with pytest.raises(ValueError, match="trace_vectors"):
        StochasticNystromCompReg(model, trace_vectors=torch.ones(3, 2, dtype=torch.float64))
    n = model.train_inputs[0].shape[0]
    bad = torch.ones(n, 2, dtype=torch.float64)
    bad[n // 2, 1] = float("nan")
    with pytest.raises(ValueError, match="trace_vectors contains NaN or Inf"):
        StochasticNystromCompReg(model, trace_vectors=bad)
    with pytest.raises(ValueError, match=r"trace_vectors must have at least one column"):
        StochasticNystromCompReg(model, trace_vectors=bad[:, :0])
    with pytest.raises(ValueError, match="ktilde_trace"):
        StochasticNystromCompReg(model, ktilde_trace="exact")


def _aggregate_errors(route: str, lengthscale: float) -> list[float]:
    """Relative errors of the float32 aggregates (``A A^T``, ``A y``, ``||A||_F^2``) of ``route`` against
    the float64 solve route with the same factor ``L`` (the float32 one, widened)."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(1500, 3, generator=g, dtype=torch.float64)
    y = torch.sin(5 * x[:, :1]) + 0.05 * torch.randn(1500, 1, generator=g, dtype=torch.float64)
    c = x[:200]
    k64 = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3)).double()
    k64.base_kernel.lengthscale = torch.full((1, 3), lengthscale, dtype=torch.float64)
    k32 = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3))
    k32.base_kernel.lengthscale = torch.full((1, 3), lengthscale)
    with torch.no_grad():
        kmm = k64(c, c).to_dense()
        jitter = float(torch.finfo(torch.float32).eps) * 200 * float(kmm.diagonal().mean())  # cholesky_kmm's first
        L32 = torch.linalg.cholesky(kmm + jitter * torch.eye(200, dtype=torch.float64)).float()
        with settings.aggregate_route("solve"):
            ref = whitened_aggregates(k64, x, y, c, L32.double(), 512)
        with settings.aggregate_route(route):
            got = whitened_aggregates(k32, x.float(), y.float(), c.float(), L32, 512)
    return [float((a.double() - b).norm() / b.norm()) for a, b in zip(got[:3], ref[:3], strict=True)]


@pytest.mark.parametrize("lengthscale", [0.1, 1.0, 3.0])  # K_MM condition numbers ~1e4, ~1e7, ~1e7 (+ jitter)
def test_float32_gram_route_is_as_accurate_as_the_solve_route(lengthscale):
    solve, gram = _aggregate_errors("solve", lengthscale), _aggregate_errors("gram", lengthscale)
    for s_err, g_err in zip(solve, gram, strict=True):
        assert g_err <= 1.5 * s_err + 1e-7, (solve, gram)
    assert max(gram) < 1e-3


def test_gram_route_is_the_cpu_float32_default_and_validated():
    L32, L64 = torch.eye(3), torch.eye(3, dtype=torch.float64)
    assert uses_gram_route(L32) and not uses_gram_route(L64)
    with settings.aggregate_route("solve"):
        assert not uses_gram_route(L32)
    with settings.aggregate_route("gram"):
        assert uses_gram_route(L64)
    with pytest.raises(ValueError, match="aggregate_route"):
        settings.aggregate_route("fast")


def test_gram_route_backward_does_not_recompute_the_center_products(monkeypatch):
    """The selective-checkpoint policy keeps each block's ``M x M`` product: the backward pass
    recomputes the kernel blocks but no block's GEMM with an ``M x M`` output, so the count of such
    GEMMs in the backward pass does not grow with the number of blocks (without the policy it does) — where the
    kept products fit the graph's share of the memory budget; beyond it they are recomputed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import gpfalkon.backend.passes as passes

    if passes.selective_contexts is None:
        pytest.skip("selective checkpointing needs torch >= 2.4")
    m = 24

    class CountMM(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.square = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default and tuple(out.shape) == (m, m):
                self.square += 1
            return out

    x, y = make_data(400, 3, dtype=torch.float32)
    model = FalkonGP(x, y, kernel=make_kernel("scale_matern52", 3, dtype=torch.float32), num_centers=m,
                     penalty=1e-3, learn_centers=True)

    def backward_square_gemms(block_rows: int) -> int:
        model.zero_grad()
        loss = GCV(model, block_rows=block_rows)()
        with CountMM() as counter:
            loss.backward()
        assert torch.isfinite(model.centers.grad).all()
        return counter.square

    # a budget the whole graph does not fit: the 4-block pass is checkpointed (the 1-block one never is)
    with settings.memory_budget(400 * m * 48 * 8 - 8):
        one, four = backward_square_gemms(400), backward_square_gemms(100)
        assert four == one
        monkeypatch.setattr(passes, "selective_contexts", None)  # recompute everything
        assert backward_square_gemms(100) == one + 4
    monkeypatch.undo()
    # 40 blocks whose M x M products (40 M (M + 1) float64 values, 192 KB) exceed the graph's share of a 1 MiB budget:
    # none is kept (each block's is recomputed in the backward pass), so the memory held between the passes does not
    # grow with the number of blocks
    with settings.memory_budget(2**20):
        one = backward_square_gemms(400)
        assert backward_square_gemms(10) == one + 40


def test_float32_objectives_with_duplicate_centers_are_finite():
    x, y = make_data(300, 3, dtype=torch.float32)
    centers = torch.cat([x[:20], x[:5]])  # duplicates: K_MM singular
    model = FalkonGP(x, y, kernel=gpytorch.kernels.RBFKernel(), centers=centers, penalty=1e-4, learn_centers=True)
    for cls in (NystromCompReg, StochasticNystromCompReg, SGPRBound, GCV):
        model.zero_grad()
        value = cls(model)()
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(model.centers.grad).all()
    # the float32 value agrees with the same objective in float64
    m64 = FalkonGP(x.double(), y.double(), kernel=gpytorch.kernels.RBFKernel().double(), centers=centers.double(),
                   penalty=1e-4)
    torch.testing.assert_close(NystromCompReg(model)().double(), NystromCompReg(m64)(), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------ MLL adapters (issue 14, item 4)
def test_mll_adapter_equals_gpytorch_sgpr_mll_and_its_gradients():
    """mll(model(x), y) = -SGPRBound / n (which test_sgpr_bound_equals_gpytorch_sgpr_loss checks
    against GPyTorch SGPR's exact MLL), with autograd's gradients of that formula."""
    from gpfalkon import NystromMarginalLogLikelihood

    model = _model(learn_centers=True)
    x, y = model.train_inputs[0], model.train_targets
    mll = NystromMarginalLogLikelihood(model.likelihood, model)  # objective "sgpr"
    model.train()
    value = mll(model(x), y)
    model.zero_grad()
    value.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    (-SGPRBound(model)() / x.shape[0]).backward()
    assert set(got) == {k for k, p in model.named_parameters() if p.grad is not None} and "centers" in got
    for k, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[k], p.grad, rtol=1e-12, atol=1e-14)
    assert value.dim() == 0 and bool(torch.isfinite(value))
    torch.testing.assert_close(value.detach(), -SGPRBound(model)().detach() / x.shape[0], rtol=1e-12, atol=1e-14)


def test_fit_gpytorch_mll_learns_and_leaves_a_fitted_model():
    """BoTorch's fit_gpytorch_mll (scipy L-BFGS-B and a torch optimizer) with the adapter lowers the
    objective, and the model comes back refitted in eval mode."""
    from botorch.fit import fit_gpytorch_mll
    from botorch.optim.fit import fit_gpytorch_mll_torch

    from gpfalkon import NystromMarginalLogLikelihood

    for optimizer in (None, fit_gpytorch_mll_torch):
        model = _model(learn_centers=False)
        x, y = model.train_inputs[0], model.train_targets
        mll = NystromMarginalLogLikelihood(model.likelihood, model, objective="nystrom-compreg")
        model.train()
        with torch.no_grad():
            before = float(mll(model(x), y))
        kw = {} if optimizer is None else {"optimizer": optimizer, "optimizer_kwargs": {"step_limit": 30}}
        fit_gpytorch_mll(mll, **kw)
        assert not model.training and bool(model.fitted) and not model._hyper_changed()
        with torch.no_grad():
            after = float(mll(model(x), y))
        assert after > before  # the (negated, per point) objective increased
        model(x[:5])  # the posterior is ready


def test_exact_mll_on_falkongp_is_refused_with_the_adapter_named():
    from gpytorch.mlls import ExactMarginalLogLikelihood

    model = _model(learn_centers=False)
    x, y = model.train_inputs[0], model.train_targets
    model.train()
    with pytest.raises(RuntimeError, match="NystromMarginalLogLikelihood"):
        ExactMarginalLogLikelihood(model.likelihood, model)(model(x), y)


def test_mll_adapter_validates_its_arguments():
    from gpfalkon import NystromMarginalLogLikelihood

    model = _model(learn_centers=False)
    with pytest.raises(ValueError, match="objective must be one of"):
        NystromMarginalLogLikelihood(model.likelihood, model, objective="nope")
    with pytest.raises(ValueError, match="model's own likelihood"):
        NystromMarginalLogLikelihood(gpytorch.likelihoods.GaussianLikelihood(), model)
    mll = NystromMarginalLogLikelihood(model.likelihood, model, objective=GCV)
    with pytest.raises(ValueError, match="training targets"):
        mll(None, model.train_targets[:3])
    # targets of the right size but other values (re-standardised, permuted) are not silently replaced by the
    # model's own; an equal copy is accepted
    y = model.train_targets
    for other in (10 * y + 3, y.flip(0), y.float()):
        with pytest.raises(ValueError, match="differ from them"):
            mll(None, other)
    torch.testing.assert_close(mll(None, y.clone()), mll(None, y))


def test_fit_gpytorch_mll_reaches_the_optimum_of_an_ordinary_loop():
    """BoTorch's fit_gpytorch_mll (scipy L-BFGS-B) and an ordinary GPyTorch loop (torch L-BFGS on
    -mll(model(x), y)) reach the same stationary point of the SGPR bound."""
    from botorch.fit import fit_gpytorch_mll

    from gpfalkon import NystromMarginalLogLikelihood

    g = torch.Generator().manual_seed(0)
    x = torch.rand(80, 2, generator=g, dtype=torch.float64)
    y = torch.sin(4 * x[:, 0]) + x[:, 1] ** 2 + 0.1 * torch.randn(80, generator=g, dtype=torch.float64)

    def make():
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        return FalkonGP(x, y, k, num_centers=20, penalty=0.05 / 80, seed=1, tol=1e-10, max_iter=500)

    a = make()
    fit_gpytorch_mll(NystromMarginalLogLikelihood(a.likelihood, a))
    b = make()
    mll_b = NystromMarginalLogLikelihood(b.likelihood, b)
    b.train()
    opt = torch.optim.LBFGS(b.parameters(), lr=1.0, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -mll_b(b(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    # the scipy solution is stationary, and both routes agree on it
    a.train()
    mll_a = NystromMarginalLogLikelihood(a.likelihood, a)
    a.zero_grad()
    (-mll_a(a(x), y)).backward()
    assert max(float(p.grad.abs().max()) for p in a.parameters() if p.grad is not None) < 1e-4
    for (k, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=False):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=1e-3, msg=k)



@pytest.fixture
def checkpoint_calls(monkeypatch):
    """A list that gets one entry per torch checkpoint the differentiable passes run."""
    import gpfalkon.backend.passes as passes

    calls: list[int] = []
    real = passes.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(passes, "checkpoint", counting)
    return calls


def _budget_just_below_the_graph(model) -> int:
    """A memory budget whose share (1 / GRAPH_SHARE) falls just short of the model's whole aggregate graph."""
    from gpfalkon.backend import AGGREGATE
    from gpfalkon.backend.blocks import GRAPH_SHARE

    n, m = model.train_inputs[0].shape[0], model.centers.shape[0]
    return n * m * AGGREGATE.graph_bytes * GRAPH_SHARE - GRAPH_SHARE


@pytest.mark.parametrize("route", ["solve", "gram"])
@pytest.mark.parametrize("name", ["GCV", "SGPRBound", "LOOCV"])
def test_small_passes_keep_their_graph_and_match_the_checkpointed_blocks(name, route, checkpoint_calls):
    """Within its share of the memory budget (or as one block) a pass runs no torch checkpoint; beyond
    it every block is checkpointed; value and gradients agree either way (and with the naive formula)."""
    calls = checkpoint_calls
    model = _model(dtype=torch.float32 if route == "gram" else torch.float64)
    params = [model.kernel.base_kernel.raw_lengthscale, model.kernel.raw_outputscale,
              model.likelihood.raw_noise, model.centers]
    results = []
    tight = _budget_just_below_the_graph(model)
    with settings.aggregate_route(route):
        for budget, rows, checkpoints in [(None, 37, False), (tight, None, False), (tight, 37, True)]:
            calls.clear()
            with settings.memory_budget(budget):
                value = OBJECTIVES[name](model, block_rows=rows)()
                results.append((value, torch.autograd.grad(value, params)))
            assert (len(calls) >= 4) if checkpoints else calls == [], (budget, rows, len(calls))
    tol = dict(rtol=1e-4, atol=1e-5) if route == "gram" else dict(rtol=1e-10, atol=1e-12)
    for value, grads in results[1:]:
        torch.testing.assert_close(value, results[0][0], **tol)
        for a, b in zip(grads, results[0][1], strict=True):
            torch.testing.assert_close(a, b, **tol)
    if route == "solve":
        torch.testing.assert_close(results[0][0], naive(name, model, OBJECTIVES[name](model)), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name", ["GCV", "HoldOut"])
def test_a_models_own_memory_budget_decides_whether_its_passes_keep_the_graph(checkpoint_calls, name):
    """The objectives run their passes under the model's ``memory_budget``: a budget the graph does not fit
    checkpoints the blocks even where the library's budget would keep them (HoldOut: its validation rows' pass
    too, checkpointed in more blocks under the model's budget than under the library's)."""
    calls = checkpoint_calls
    model = _model()
    # HoldOut's passes each take a part of the rows: a budget that neither part's graph fits
    tight = _budget_just_below_the_graph(model) // (1 if name == "GCV" else 8)
    model.memory_budget = tight
    with settings.memory_budget(2**40):
        value = OBJECTIVES[name](model, block_rows=37)()
    own = len(calls)
    assert own >= 4
    calls.clear()
    model.memory_budget = None
    with settings.memory_budget(2**40):
        torch.testing.assert_close(OBJECTIVES[name](model, block_rows=37)(), value, rtol=1e-10, atol=1e-12)
    assert calls == []
    if name == "HoldOut":  # the whole pass (both parts) checkpointed under the budget set library-wide
        calls.clear()
        with settings.memory_budget(tight):
            OBJECTIVES[name](model, block_rows=37)()
        assert own == len(calls)


@pytest.mark.parametrize("t", [1, 3])
def test_gram_projection_backward_matches_autograd(t):
    """The Gram route's ``(K^T K, K^T y)`` with its hand-written backward (the rank-one update for one column):
    gradcheck, and the gradients of autograd's own products for each output alone and for both."""
    from gpfalkon.backend.passes import _GramProjection

    g = torch.Generator().manual_seed(t)
    kb = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    yb = torch.randn(7, t, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_GramProjection.apply, (kb, yb))
    wg, wp = torch.randn(5, 5, generator=g, dtype=torch.float64), torch.randn(5, t, generator=g, dtype=torch.float64)
    for use_gram, use_proj in ((True, True), (True, False), (False, True)):
        gram, proj = _GramProjection.apply(kb, yb)
        loss = sum([(gram * wg).sum()] * use_gram + [(proj * wp).sum()] * use_proj)
        ours = torch.autograd.grad(loss, (kb, yb), allow_unused=True)
        loss_ref = sum([((kb.mT @ kb) * wg).sum()] * use_gram + [((kb.mT @ yb) * wp).sum()] * use_proj)
        ref = torch.autograd.grad(loss_ref, (kb, yb), allow_unused=True)
        for a, b in zip(ours, ref, strict=True):
            if b is None or not b.abs().sum():
                assert a is None or not a.abs().sum()
            else:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_cholesky_kmm_falls_back_to_the_jitter_search_when_the_first_factor_fails(monkeypatch):
    """``cholesky_kmm`` factors once under autograd; where that first try fails (``info > 0``) it asks
    ``jittered_cholesky`` for the jitter and factors again. Both routes must give the same factor and
    the same gradients as autograd through a direct factorisation at the first jitter."""
    model = _model()
    obj = GCV(model)

    def reference():
        kmm = model.kernel(model.centers, model.centers).to_dense()
        first = float(torch.finfo(kmm.dtype).eps) * kmm.shape[0] * float(kmm.detach().diagonal().mean())
        return torch.linalg.cholesky(kmm + first * torch.eye(kmm.shape[0], dtype=kmm.dtype))

    params = [*model.kernel.parameters(), model.centers]  # what K_MM depends on
    ref = reference()
    g_ref = torch.autograd.grad(ref.square().sum(), params)
    fast = obj.cholesky_kmm()
    g_fast = torch.autograd.grad(fast.square().sum(), params)

    real = torch.linalg.cholesky_ex
    calls = []

    def failing_first_try(a, *args, **kwargs):  # jittered_cholesky's own tries (out=...) are left alone
        out = real(a, *args, **kwargs)
        if "out" in kwargs:
            return out
        calls.append(1)
        return out[0], torch.ones_like(out[1])  # report a failed factorisation

    monkeypatch.setattr(torch.linalg, "cholesky_ex", failing_first_try)
    slow = obj.cholesky_kmm()
    g_slow = torch.autograd.grad(slow.square().sum(), params)
    assert calls == [1]
    for got in (fast, slow):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    for grads in (g_fast, g_slow):
        for g, r in zip(grads, g_ref, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


def test_cholesky_kmm_names_a_non_finite_kmm():
    model = _model()
    with torch.no_grad():
        model.centers[0, 0] = float("nan")
    with pytest.raises(ValueError, match="K_MM contains NaN or Inf"):
        GCV(model).cholesky_kmm()


@pytest.mark.parametrize("name", ["gcv", "loocv", "holdout"])
def test_mll_of_a_mean_objective_is_per_observation_and_fit_gpytorch_mll_learns(name):
    """GCV, LOOCV and HoldOut are means over rows: the MLL is minus the objective per output (not divided by n
    again), so fit_gpytorch_mll's L-BFGS-B moves the hyperparameters and lowers the objective (it stopped at the
    start on gradients ~1e-6 before)."""
    from botorch.fit import fit_gpytorch_mll

    from gpfalkon import NystromMarginalLogLikelihood

    model = _model(n=400, m=30, learn_centers=False)
    mll = NystromMarginalLogLikelihood(model.likelihood, model, objective=name)
    obj = mll.objective
    start = float(obj())
    model.train()
    torch.testing.assert_close(mll(None, model.train_targets), -obj(), rtol=1e-12, atol=1e-14)
    ls0 = model.kernel.base_kernel.lengthscale.detach().clone()
    fit_gpytorch_mll(mll)
    assert float(obj()) < 0.95 * start
    assert not torch.allclose(model.kernel.base_kernel.lengthscale.detach(), ls0, rtol=1e-3)


def test_objectives_follow_a_change_of_the_training_data():
    """After model.set_train_data with another number of rows, HoldOut draws a split of the new rows and the
    stochastic objective new trace vectors and a new subset (their values then equal fresh objectives' built with
    the same generator state's draws on the new rows); given trace vectors are refused by name."""
    model = _model(n=100)
    x, y = make_data(160, 2, dtype=torch.float64, seed=7)
    ho = HoldOut(model)
    ho()
    st = StochasticNystromCompReg(model, num_trace_vectors=4, cg_tol=1e-10)
    st()
    given = StochasticNystromCompReg(model, trace_vectors=torch.ones(100, 2, dtype=torch.float64))
    model.set_train_data(x, y)
    tr, va = ho.split()
    assert tr.numel() + va.numel() == 160 and sorted(torch.cat([tr, va]).tolist()) == list(range(160))
    assert ho.n_val == 80 and torch.isfinite(ho())
    value = st()
    assert st.trace_vectors.shape == (160, 4) and torch.isfinite(value)
    with pytest.raises(ValueError, match="trace_vectors were given for 100 rows; the model now has 160"):
        given()
    model.set_train_data(x[:30], y[:30])
    assert torch.isfinite(ho()) and ho.n_val == 15


@pytest.mark.parametrize("kw", [dict(cg_tol=-1.0), dict(cg_tol=float("inf")), dict(cg_tol="abc"),
                                dict(cg_iterations=2.7), dict(num_trace_vectors=2.5), dict(subsample_size=0)])
def test_stochastic_objective_options_are_checked_by_name(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name} must be"):
        StochasticNystromCompReg(_model(), **kw)
