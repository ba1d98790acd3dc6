"""FastfoodKernel and fwht: exact algebra against dense references, convergence to the exact kernels,
distribution of the frequencies, and the GPyTorch kernel interface."""
from __future__ import annotations

import math

import gpytorch
import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch
from linear_operator.operators import LowRankRootLinearOperator, MatmulLinearOperator

from gpfalkon.kernels.fastfood import FastfoodKernel, fwht

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hadamard(d: int) -> torch.Tensor:
    return torch.as_tensor(scipy.linalg.hadamard(d), dtype=F64)


def _kernel(num_samples: int, d: int, seed: int = 0, nu=None, ard: bool = True, **kw) -> FastfoodKernel:
    k = FastfoodKernel(num_samples, num_dims=d, nu=nu, generator=_gen(seed), ard_num_dims=d if ard else None, **kw)
    k = k.double()
    if ard:
        k.lengthscale = torch.linspace(0.5, 1.5, d, dtype=F64)
    else:
        k.lengthscale = 0.9
    return k


def _reference_frequencies(k: FastfoodKernel) -> torch.Tensor:
    """V from the stored buffers with scipy's Hadamard matrix and explicit diagonals (no fwht, no frequencies())."""
    dp = k.ff_gauss.shape[-1]
    h = _hadamard(dp)
    blocks = []
    for b in range(k.ff_gauss.shape[-2]):
        bmat = torch.diag(k.ff_signs[b])
        pmat = torch.zeros(dp, dp, dtype=F64)
        pmat[torch.arange(dp), k.ff_perm[b]] = 1.0  # (P y)_i = y_{perm(i)}
        gmat = torch.diag(k.ff_gauss[b])
        smat = torch.diag(k.ff_scale[b])
        blocks.append(smat @ h @ gmat @ pmat @ h @ bmat / math.sqrt(dp))
    return torch.cat(blocks, 0)[: k.num_samples, : k.num_dims]


# --------------------------------------------------------------------------- fwht
@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_fwht_equals_dense_hadamard(d):
    x = torch.randn(3, 4, d, dtype=F64, generator=_gen(d))
    torch.testing.assert_close(fwht(x), x @ _hadamard(d), rtol=1e-12, atol=1e-12)
    # unbatched, and H H = d I
    torch.testing.assert_close(fwht(x[0, 0]), x[0, 0] @ _hadamard(d), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fwht(fwht(x)), d * x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", [0, 3, 6, 12])
def test_fwht_rejects_non_power_of_two(d):
    with pytest.raises(ValueError, match="`x`"):
        fwht(torch.randn(2, d))


@pytest.mark.parametrize("d", [8, 256])  # one dense matmul; the Kronecker split
def test_fwht_is_differentiable(d):
    x = torch.randn(2, d, dtype=F64, requires_grad=True, generator=_gen(1))
    assert torch.autograd.gradcheck(fwht, (x,))


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """Textbook in-order FWHT (log2 d butterfly passes), an independent reference for large d."""
    y = x.clone()
    d, h = y.shape[-1], 1
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape)


@pytest.mark.parametrize("d", [128, 256, 1024, 1 << 15])  # dense; 16 x 16; 32 x 32; (16 x 16) x 128
def test_fwht_kronecker_split_equals_butterfly(d):
    x = torch.randn(2, 3, d, dtype=F64, generator=_gen(d + 1))
    torch.testing.assert_close(fwht(x), _butterfly(x), rtol=1e-12, atol=1e-10)
    if d <= 1024:
        torch.testing.assert_close(fwht(x), x @ _hadamard(d), rtol=1e-12, atol=1e-10)
    # non-contiguous input, and float32
    xt = torch.randn(d, 3, dtype=F64, generator=_gen(d + 2)).T
    torch.testing.assert_close(fwht(xt), _butterfly(xt.contiguous()), rtol=1e-12, atol=1e-10)
    x32 = x.float()
    torch.testing.assert_close(fwht(x32), _butterfly(x).float(), rtol=1e-4, atol=1e-3 * math.sqrt(d))


@pytest.mark.parametrize("d,n", [(5, 30), (5, 4), (200, 300), (200, 100), (1500, 50), (1500, 2100)])
def test_dense_and_structured_projections_agree(d, n):
    """``_project`` picks the dense frequency matrix for d' <= 2048 and n >= d', the structured
    transform otherwise; both must equal x @ V^T with V built densely from the buffers."""
    k = _kernel(32 if d > 1000 else 300, d, seed=21)
    x = torch.randn(n, d, dtype=F64, generator=_gen(22))
    v = k.frequencies()
    expected = x @ v.T
    torch.testing.assert_close(k._project(x), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(k._project_structured(x), expected, rtol=1e-10, atol=1e-10)


def test_inputs_of_another_dtype_are_evaluated_in_theirs():
    """As GPyTorch's kernels promote, a float64 kernel evaluates float32 inputs (in float32) and a float32 kernel
    float64 ones (in float64, e.g. FalkonGP's K_MM), from the same random draws."""
    k64 = _kernel(16, 3)
    k32 = _kernel(16, 3).float()
    x = torch.rand(5, 3, dtype=F64, generator=_gen(30))
    ref = k64(x).to_dense()
    got32 = k64(x.float()).to_dense()  # promoted by the float64 lengthscale, as GPyTorch's RBF does
    torch.testing.assert_close(got32.double(), ref, rtol=1e-5, atol=1e-6)
    got64 = k32(x).to_dense()
    assert got64.dtype == F64
    torch.testing.assert_close(got64, ref, rtol=1e-6, atol=1e-7)  # the float32 copy of the draws


def test_a_float32_falkon_gp_fits_with_fastfood_as_in_float64():
    """FalkonGP evaluates K_MM in float64 with a float32 model's kernel: a float32 Fastfood model fits, and
    predicts as the float64 model from the same draws (CG and the direct solve)."""
    from gpfalkon import FalkonGP, FalkonOptions

    x = torch.randn(300, 5, dtype=F64, generator=_gen(31))
    y = torch.sin(x[:, 0])
    preds = []
    for dt in (torch.float32, F64):
        k = _kernel(64, 5).to(dt)  # rank 128 > M: a well-posed problem in float32 too
        for method in ("cg", "direct"):
            m = FalkonGP(x.to(dt), y.to(dt), k, num_centers=50, penalty=1e-3, seed=0, tol=1e-10, max_iter=500,
                         options=FalkonOptions(solve_method=method)).fit().eval()
            preds.append(m.posterior_mean(x[:10].to(dt)).double())
    for p in preds[:2]:
        torch.testing.assert_close(p, preds[2], rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------- exact algebra
@pytest.mark.parametrize("d,num_samples,nu", [(5, 37, None), (8, 16, None), (3, 10, 1.5), (1, 5, 0.5), (12, 50, 2.5)])
def test_featurize_matches_dense_frequencies(d, num_samples, nu):
    k = _kernel(num_samples, d, seed=3, nu=nu)
    dp = 1 << (d - 1).bit_length()
    assert k.ff_gauss.shape == (math.ceil(num_samples / dp), dp)
    v_ref = _reference_frequencies(k)
    v = k.frequencies()
    assert v.shape == (num_samples, d)
    torch.testing.assert_close(v, v_ref, rtol=1e-12, atol=1e-12)

    x = torch.randn(2, 9, d, dtype=F64, generator=_gen(4))
    proj = (x / k.lengthscale) @ v_ref.T
    expected = torch.cat([proj.cos(), proj.sin()], -1)
    z = k._featurize(x)
    assert z.shape == (2, 9, 2 * num_samples)
    torch.testing.assert_close(z, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(k._featurize(x, normalize=True), expected / math.sqrt(num_samples))


def test_rows_have_the_prescribed_norms():
    # with d a power of two there is no padding: row norms are exactly the stored s_i = scale_i * ||g||
    k = _kernel(64, 8, seed=5)
    v = k.frequencies()
    s = (k.ff_scale * k.ff_gauss.norm(dim=-1, keepdim=True)).reshape(-1)
    torch.testing.assert_close(v.norm(dim=-1), s, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- convergence
_DS = (64, 256, 1024, 4096)
_SEEDS = range(8)


def _conv_data():
    x = torch.rand(50, 6, dtype=F64, generator=_gen(123))
    ls = torch.linspace(0.7, 1.3, 6, dtype=F64)
    return x, ls


def _exact(nu, x, ls):
    if nu is None:
        k = gpytorch.kernels.RBFKernel(ard_num_dims=6)
    else:
        k = gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=6)
    k = k.double()
    k.lengthscale = ls
    with torch.no_grad():
        return k(x).to_dense()


def _fastfood_errors(nu, x, ls, exact):
    errs = []
    for D in _DS:
        e = []
        for seed in _SEEDS:
            k = FastfoodKernel(D, num_dims=6, nu=nu, generator=_gen(1000 * D + seed), ard_num_dims=6).double()
            k.lengthscale = ls
            with torch.no_grad():
                e.append(((k(x).to_dense() - exact).norm() / x.shape[0]).item())
        errs.append(float(np.mean(e)))
    return np.array(errs)


def _check_rate(errs):
    assert all(errs[i + 1] < errs[i] * 0.8 for i in range(len(errs) - 1)), errs
    ratio = errs[0] / errs[-1]
    assert 4.0 <= ratio <= 16.0, (ratio, errs)  # 1/sqrt(D): sqrt(4096/64) = 8
    slope = np.polyfit(np.log(_DS), np.log(errs), 1)[0]
    assert -0.75 <= slope <= -0.3, (slope, errs)


def test_converges_to_rbf_like_rff():
    x, ls = _conv_data()
    exact = _exact(None, x, ls)
    errs = _fastfood_errors(None, x, ls, exact)
    _check_rate(errs)
    assert errs[-1] < 0.02, errs

    rff_errs = []
    with torch.random.fork_rng():
        for D in _DS:
            e = []
            for seed in _SEEDS:
                torch.manual_seed(seed)
                k = gpytorch.kernels.RFFKernel(D, num_dims=6, ard_num_dims=6).double()
                k.lengthscale = ls
                with torch.no_grad():
                    e.append(((k(x).to_dense() - exact).norm() / x.shape[0]).item())
            rff_errs.append(float(np.mean(e)))
    ratio = errs / np.array(rff_errs)
    assert np.all((ratio > 1 / 3) & (ratio < 3)), (errs, rff_errs)


@pytest.mark.parametrize("nu", [1.5, 2.5])
def test_converges_to_matern(nu):
    x, ls = _conv_data()
    errs = _fastfood_errors(nu, x, ls, _exact(nu, x, ls))
    _check_rate(errs)
    assert errs[-1] < 0.02, errs


def test_matern12_single_size():
    x, ls = _conv_data()
    exact = _exact(0.5, x, ls)
    errs = []
    for seed in range(4):
        k = FastfoodKernel(4096, num_dims=6, nu=0.5, generator=_gen(seed), ard_num_dims=6).double()
        k.lengthscale = ls
        with torch.no_grad():
            errs.append(((k(x).to_dense() - exact).norm() / 50).item())
    assert np.mean(errs) < 0.02, errs
    # the wrong spectral measure (RBF) is far off
    k = FastfoodKernel(4096, num_dims=6, generator=_gen(0), ard_num_dims=6).double()
    k.lengthscale = ls
    with torch.no_grad():
        assert ((k(x).to_dense() - exact).norm() / 50).item() > 0.05


# --------------------------------------------------------------------------- frequency distribution
def test_frequency_marginals_rbf():
    d = 5  # padded to d' = 8: only the first 5 columns are ever used
    k = FastfoodKernel(8192, num_dims=d, generator=_gen(7), ard_num_dims=d).double()
    ls = torch.linspace(0.5, 2.0, d, dtype=F64)
    k.lengthscale = ls
    v = k.frequencies()
    # effective frequencies V / l: every entry has second moment 1 / l_j^2
    eff = v / ls
    torch.testing.assert_close(eff.square().mean(0), ls.pow(-2), rtol=0.05, atol=0)
    assert abs(v.mean().item()) < 0.03
    # each row restricted to d coordinates is N(0, I_d): its norm is chi_d
    assert scipy.stats.kstest(v.norm(dim=-1).numpy(), scipy.stats.chi(d).cdf).pvalue > 1e-3
    # and not chi_{d'} (the padded dimension)
    assert scipy.stats.kstest(v.norm(dim=-1).numpy(), scipy.stats.chi(8).cdf).pvalue < 1e-6
    # rows of the unpadded case have chi_{d'} norms
    k8 = FastfoodKernel(4096, num_dims=8, generator=_gen(8)).double()
    norms = k8.frequencies().norm(dim=-1).numpy()
    assert scipy.stats.kstest(norms, scipy.stats.chi(8).cdf).pvalue > 1e-3
    assert abs(norms.mean() - scipy.stats.chi(8).mean()) < 0.05


@pytest.mark.parametrize("nu", [0.5, 1.5, 2.5])
def test_frequency_marginals_matern(nu):
    d = 3  # padded to 4; each row restricted to 3 coordinates is multivariate t_{2 nu}: |w|^2 / d ~ F(d, 2 nu)
    k = FastfoodKernel(4096, num_dims=d, nu=nu, generator=_gen(9)).double()
    w2 = k.frequencies().square().sum(-1).numpy() / d
    assert scipy.stats.kstest(w2, scipy.stats.f(d, 2 * nu).cdf).pvalue > 1e-3


# --------------------------------------------------------------------------- interface
def test_returned_operators_and_diag():
    k = _kernel(8, 3, seed=1)
    x = torch.rand(30, 3, dtype=F64, generator=_gen(2))
    y = torch.rand(30, 3, dtype=F64, generator=_gen(3))
    out = k.forward(x, x)
    assert isinstance(out, LowRankRootLinearOperator)  # 2D = 16 < n = 30
    z = k._featurize(x, normalize=True)
    torch.testing.assert_close(out.to_dense(), z @ z.T)
    assert isinstance(k.forward(x, y), MatmulLinearOperator)
    with torch.no_grad():
        full = k(x).to_dense()
        torch.testing.assert_close(k(x, diag=True), full.diagonal())
        torch.testing.assert_close(k(x, diag=True), torch.ones(30, dtype=F64))  # cos^2 + sin^2
        torch.testing.assert_close(k(x, y, diag=True), k(x, y).to_dense().diagonal())


def test_scale_kernel_and_gradients():
    base = _kernel(64, 4, seed=2)
    sk = gpytorch.kernels.ScaleKernel(base).double()
    sk.outputscale = 2.5
    x = torch.rand(20, 4, dtype=F64, generator=_gen(5), requires_grad=True)
    k_full = sk(x).to_dense()
    torch.testing.assert_close(k_full, 2.5 * base(x).to_dense())
    k_full.sum().backward()
    assert base.raw_lengthscale.grad is not None and torch.isfinite(base.raw_lengthscale.grad).all()
    assert base.raw_lengthscale.grad.abs().sum() > 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_exact_gp_marginal_likelihood_and_prediction():
    x = torch.rand(40, 2, dtype=F64, generator=_gen(6))
    y = torch.sin(4 * x[:, 0]) + x[:, 1]

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            lik = gpytorch.likelihoods.GaussianLikelihood()
            super().__init__(x, y, lik)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = FastfoodKernel(32, num_dims=2, generator=_gen(0))

        def forward(self, t):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(t), self.covar_module(t))

    model = GP().double()
    model.likelihood.noise = 0.1
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    loss = -mll(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    model.eval()
    xt = torch.rand(5, 2, dtype=F64, generator=_gen(7))
    with torch.no_grad():
        mean = model(xt).mean
        k = model.covar_module
        kxx = k(x).to_dense() + 0.1 * torch.eye(40, dtype=F64)
        ref = k(xt, x).to_dense() @ torch.linalg.solve(kxx, y)
    torch.testing.assert_close(mean, ref, rtol=1e-6, atol=1e-6)


def test_state_dict_roundtrip_dtype_and_lazy_init():
    k = _kernel(20, 3, seed=11)
    x = torch.rand(15, 3, dtype=F64, generator=_gen(12))
    with torch.no_grad():
        ref = k(x).to_dense()
        # eager kernel with other random parameters
        k2 = FastfoodKernel(20, num_dims=3, generator=_gen(99), ard_num_dims=3).double()
        assert not torch.allclose(k2(x).to_dense(), ref)
        k2.load_state_dict(k.state_dict())
        torch.testing.assert_close(k2(x).to_dense(), ref, rtol=0, atol=0)
        # lazily constructed kernel
        k3 = FastfoodKernel(20, ard_num_dims=3).double()
        k3.load_state_dict(k.state_dict())
        assert k3.num_dims == 3
        torch.testing.assert_close(k3(x).to_dense(), ref, rtol=0, atol=0)
        with pytest.raises(ValueError, match="nu"):
            FastfoodKernel(20, num_dims=3, nu=1.5, ard_num_dims=3).double().load_state_dict(k.state_dict())

        # float32 kernel -> .double()
        k4 = FastfoodKernel(20, num_dims=3, generator=_gen(11), ard_num_dims=3)
        k4.lengthscale = k.lengthscale.float()
        assert k4.ff_gauss.dtype == torch.float32 and k4.ff_perm.dtype == torch.long
        out32 = k4(x.float()).to_dense()
        torch.testing.assert_close(out32, ref.float(), rtol=1e-4, atol=1e-4)
        k4 = k4.double()
        assert k4.ff_gauss.dtype == F64 and k4.ff_perm.dtype == torch.long
        out64 = k4(x).to_dense()
        assert out64.dtype == F64
        torch.testing.assert_close(out64, ref, rtol=1e-6, atol=1e-6)


def test_lazy_init_matches_eager():
    x = torch.rand(10, 5, dtype=F64, generator=_gen(13))
    lazy = FastfoodKernel(30, generator=_gen(21)).double()
    assert lazy.num_dims is None and not hasattr(lazy, "ff_gauss")
    with pytest.raises(RuntimeError, match="not initialised yet"):
        lazy.frequencies()
    with torch.no_grad():
        k_lazy = lazy(x).to_dense()
        assert lazy.num_dims == 5 and lazy.ff_gauss.shape == (4, 8) and lazy.ff_gauss.dtype == F64
        # the eager kernel drew its parameters in float32 (then .double()): equal up to float32 rounding
        eager = FastfoodKernel(30, num_dims=5, generator=_gen(21)).double()
        torch.testing.assert_close(k_lazy, eager(x).to_dense(), rtol=1e-6, atol=1e-6)
        # same dtype at draw time: bitwise identical
        lazy32 = FastfoodKernel(30, generator=_gen(21))
        k_lazy32 = lazy32(x.float()).to_dense()
        eager32 = FastfoodKernel(30, num_dims=5, generator=_gen(21))
        torch.testing.assert_close(k_lazy32, eager32(x.float()).to_dense(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="x1"):
        lazy(torch.rand(10, 4, dtype=F64)).to_dense()


def test_generator_determinism():
    x = torch.rand(12, 4, dtype=F64, generator=_gen(14))
    with torch.no_grad():
        a = _kernel(50, 4, seed=1)(x).to_dense()
        b = _kernel(50, 4, seed=1)(x).to_dense()
        c = _kernel(50, 4, seed=2)(x).to_dense()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - c).abs().max() > 1e-3
    # without a generator: torch's global RNG
    with torch.random.fork_rng():
        torch.manual_seed(5)
        v1 = FastfoodKernel(50, num_dims=4).frequencies()
        torch.manual_seed(5)
        v2 = FastfoodKernel(50, num_dims=4).frequencies()
        v3 = FastfoodKernel(50, num_dims=4).frequencies()
    torch.testing.assert_close(v1, v2, rtol=0, atol=0)
    assert not torch.allclose(v1, v3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_samples"):
        FastfoodKernel(0)
    with pytest.raises(ValueError, match="num_samples"):
        FastfoodKernel(3.5)
    with pytest.raises(ValueError, match="num_dims"):
        FastfoodKernel(10, num_dims=0)
    with pytest.raises(ValueError, match="nu"):
        FastfoodKernel(10, nu=1.0)
    with pytest.raises(ValueError, match="nu"):
        FastfoodKernel(10, nu=3.5)
    k = FastfoodKernel(10, num_dims=3)
    with pytest.raises(ValueError, match="x1"):
        k(torch.rand(5, 4)).to_dense()
    with pytest.raises(ValueError, match="`x1` contains 1 NaN"):
        k(torch.tensor([[0.0, float("nan"), 1.0]])).to_dense()
    with pytest.raises(ValueError, match="`x2` contains 1 NaN"):
        k(torch.rand(2, 3), torch.tensor([[0.0, float("inf"), 1.0]])).to_dense()
    with pytest.raises(ValueError, match="`x1` must be a floating-point"):
        k(torch.ones(2, 3, dtype=torch.long)).to_dense()
    # any integer type for the sizes (not bool)
    assert FastfoodKernel(np.int64(16), num_dims=np.int32(3)).num_samples == 16
    with pytest.raises(ValueError, match="num_samples"):
        FastfoodKernel(True)
    with pytest.raises(ValueError, match="`x`"):
        k._featurize(torch.rand(5, 2))


def test_batched_inputs_and_batched_kernel():
    k = _kernel(40, 3, seed=15)
    xb = torch.rand(4, 11, 3, dtype=F64, generator=_gen(16))
    with torch.no_grad():
        kb = k(xb).to_dense()
        assert kb.shape == (4, 11, 11)
        for i in range(4):
            torch.testing.assert_close(kb[i], k(xb[i]).to_dense())
        yb = torch.rand(4, 7, 3, dtype=F64, generator=_gen(17))
        kxy = k(xb, yb).to_dense()
        assert kxy.shape == (4, 11, 7)
        torch.testing.assert_close(kxy[2], k(xb[2], yb[2]).to_dense())

    # kernel batch_shape: independent frequencies per batch member
    kbat = FastfoodKernel(40, num_dims=3, generator=_gen(18), batch_shape=torch.Size([2]), ard_num_dims=3).double()
    kbat.lengthscale = torch.tensor([[[0.5, 1.0, 2.0]], [[1.0, 1.0, 1.0]]], dtype=F64)
    assert kbat.ff_gauss.shape == (2, 10, 4)
    v = kbat.frequencies()
    assert v.shape == (2, 40, 3) and not torch.allclose(v[0], v[1])
    x2 = torch.rand(2, 9, 3, dtype=F64, generator=_gen(19))
    proj = (x2 / kbat.lengthscale) @ v.transpose(-1, -2)
    torch.testing.assert_close(kbat._featurize(x2), torch.cat([proj.cos(), proj.sin()], -1))
    with torch.no_grad():
        assert kbat(x2).to_dense().shape == (2, 9, 9)



@pytest.mark.parametrize("d", [3, 3000])  # dense path; structured path (d' > 2048)
def test_empty_inputs(d):
    k = FastfoodKernel(8, num_dims=d)
    x = torch.rand(4, d)
    assert k._featurize(torch.rand(0, d)).shape == (0, 16)
    with torch.no_grad():
        assert k(torch.rand(0, d), x).to_dense().shape == (0, 4)
        assert k(x, torch.rand(0, d)).to_dense().shape == (4, 0)
