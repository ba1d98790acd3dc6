r"""Fastfood random features: RFF-style kernel approximations in loglinear time.

Random Fourier features (Rahimi & Recht, 2008) approximate a stationary kernel by
:math:`k(x, x') \approx \frac1D \sum_{i=1}^D \cos(\omega_i^\top (x - x'))` with
:math:`\omega_i` drawn from the kernel's spectral measure. Storing the dense
:math:`D \times d` frequency matrix costs :math:`O(Dd)` memory and applying it to
:math:`n` points costs :math:`O(nDd)` time.

Fastfood (Q. Le, T. Sarlós, A. Smola, "Fastfood -- Approximating Kernel Expansions
in Loglinear Time", ICML 2013) replaces the dense Gaussian matrix by stacked
structured blocks. With :math:`d' = 2^{\lceil \log_2 d \rceil}` (inputs are padded
with zeros to length :math:`d'`), each :math:`d' \times d'` block is

.. math::
    V = \frac{1}{\sigma \sqrt{d'}}\, S H G \Pi H B,

where :math:`B` is a diagonal of random signs, :math:`H` the (unnormalised,
Sylvester-ordered) Walsh--Hadamard matrix, :math:`\Pi` a random permutation,
:math:`G` a diagonal of iid :math:`\mathcal N(0, 1)` entries and
:math:`S = \mathrm{diag}(s_i / \lVert g \rVert_2)`. Given :math:`B` and :math:`\Pi`,
the rows of :math:`HB` permuted by :math:`\Pi` are orthogonal with norm
:math:`\sqrt{d'}`, so row :math:`i` of :math:`HG\Pi HB` is
:math:`\sum_k (H_{ik} g_k)\, (\Pi H B)_{k,:}` -- a :math:`\mathcal N(0, d' I)` vector
of norm :math:`\sqrt{d'}\lVert g\rVert_2`. Rescaling by :math:`S / \sqrt{d'}` keeps its
(uniform) direction and gives it norm :math:`s_i`. Hence

* RBF (``nu=None``): :math:`s_i \sim \chi_{d'}`, each row is exactly
  :math:`\mathcal N(0, I_{d'})` and the estimator is unbiased, like RFF (rows within a
  block are dependent, rows of different blocks independent);
* Matérn :math:`\nu \in \{1/2, 3/2, 5/2\}` (GPyTorch's convention): the spectral
  measure is a multivariate Student-t with :math:`2\nu` degrees of freedom, so
  :math:`s_i = \chi_{d'} \cdot \sqrt{2\nu / u_i}` with :math:`u_i \sim \chi^2_{2\nu}`.

Here :math:`\sigma = 1` because inputs are divided by the lengthscale first (ARD
supported). Only the first ``d`` columns of :math:`V` ever see data; their rows are
exactly :math:`\mathcal N(0, I_d)` (resp. Student-t) distributed.

Cost: :math:`O(n D \log d')` time for the features of :math:`n` points and
:math:`O(D)` memory for the random parameters, versus :math:`O(nDd)` time and
:math:`O(Dd)` memory for :class:`gpytorch.kernels.RFFKernel`. The transform
(:func:`fwht`) runs as blocked Hadamard matmuls. For small inputs (:math:`d' \le 2048`
and at least :math:`d'` points) the features apply the :math:`D \times d` frequency
matrix, built per call by the structured transform, with one matmul instead: the
same numbers, and faster on CPU, where a BLAS matmul with :math:`2d` flops per
feature beats the memory-bound elementwise passes of the structured product
(``benchmarks/fastfood.py`` measures both; the parameters stay :math:`O(D)`).
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any

import torch
from gpytorch.kernels import Kernel
from gpytorch.models import exact_prediction_strategies
from linear_operator.operators import LowRankRootLinearOperator, MatmulLinearOperator, RootLinearOperator
from torch import Tensor

from ..backend.blocks import row_blocks

__all__ = ["FastfoodKernel", "fwht"]

_SUPPORTED_NU = (0.5, 1.5, 2.5)
# normals drawn per chunk when sampling chi variables (bounds the transient memory)
_CHI_CHUNK = 1 << 20
# largest Hadamard order applied as a single dense matmul inside ``fwht``
_FWHT_BLOCK = 128
# padded input dimensions up to which the features use the dense D x d frequency matrix
# (built by the structured transform, then one BLAS matmul): faster than the structured
# transform on CPU up to about this size (``benchmarks/fastfood.py``)
_DENSE_MAX_DIMS = 2048


def _positive_int(name: str, value: Any, extra: str = "") -> int:
    """``value`` as an ``int >= 1`` (any integer type, e.g. ``numpy.int64``; not bool)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        out = 0
    if out < 1:
        raise ValueError(
            f"FastfoodKernel: `{name}` must be a positive integer{' ' + extra if extra else ''}, got {value!r}"
        )
    return out


def _is_power_of_two(d: int) -> bool:
    return d >= 1 and (d & (d - 1)) == 0


def _next_power_of_two(d: int) -> int:
    return 1 << (d - 1).bit_length()


def fwht(x: Tensor) -> Tensor:
    r"""Unnormalised fast Walsh--Hadamard transform along the last dimension.

    Returns ``x @ H`` for the Sylvester-ordered Hadamard matrix ``H`` of order
    ``d = x.shape[-1]`` (``H`` is symmetric, ``H @ H = d I``). Batched over all
    leading dimensions, device/dtype agnostic and differentiable (plain torch ops).

    Algorithm: Sylvester matrices factor as Kronecker products,
    :math:`H_{ab} = H_a \otimes H_b`, and for a row vector :math:`x` reshaped
    row-major into an :math:`a \times b` matrix :math:`X`,
    :math:`x (H_a \otimes H_b) = \mathrm{vec}(H_a X H_b)`. Orders up to
    ``_FWHT_BLOCK`` (128) are one matmul with the dense (cached) ``H``; larger orders
    split into two balanced factors recursively. That is :math:`O(d \log d)` work per
    row with a constant of at most :math:`2 \cdot 128 / 7 \approx 37` flops per
    doubling, all inside BLAS: on a 2-core CPU it runs 5-10x faster than the
    :math:`\log_2 d` elementwise butterfly passes it replaces, which are bound by
    memory bandwidth (``benchmarks/fastfood.py``).

    :param x: tensor whose last dimension is a power of two.
    :raises ValueError: if ``x`` is a scalar or its last dimension is not a power of two.
    """
    if x.dim() == 0:
        raise ValueError("fwht: `x` must have at least one dimension")
    d = x.shape[-1]
    if not _is_power_of_two(d):
        raise ValueError(f"fwht: the last dimension of `x` must be a power of two, got {d}")
    return _fwht(x)


def _fwht(x: Tensor) -> Tensor:
    d = x.shape[-1]
    if d <= _FWHT_BLOCK:
        return x @ _hadamard(d, x.dtype, x.device)
    lead = x.shape[:-1]
    b = 1 << ((d.bit_length() - 1 + 1) // 2)  # balanced split d = a * b, both powers of two
    y = _fwht(x.reshape(*lead, d // b, b))  # X H_b
    y = _fwht(y.transpose(-1, -2)).transpose(-1, -2)  # H_a (X H_b)
    return y.reshape(*lead, d)


@functools.lru_cache(maxsize=64)
def _hadamard(d: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Cached dense Sylvester Hadamard matrix (orders <= ``_FWHT_BLOCK``: at most 64 KiB each)."""
    return _sylvester_hadamard(d, dtype, device)


def _sylvester_hadamard(d: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Dense Sylvester Hadamard matrix of order ``d`` (a power of two)."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=dtype, device=device)
    while h.shape[-1] < d:
        h = torch.kron(h2, h)
    return h


class FastfoodKernel(Kernel):
    r"""Fastfood approximation of the RBF (``nu=None``) or Matérn (``nu`` in {0.5, 1.5, 2.5}) kernel.

    Drop-in replacement for :class:`gpytorch.kernels.RFFKernel` (same features
    :math:`z(x) = [\cos(Vx/\ell), \sin(Vx/\ell)]`, same returned operators), but the
    ``num_samples x num_dims`` frequency matrix :math:`V` is the Fastfood product
    :math:`\frac{1}{\sqrt{d'}} S H G \Pi H B` (see the module docstring) and is applied
    by fast Walsh--Hadamard transforms, never formed densely.

    :param num_samples: number of random frequencies :math:`D` (``2D`` features).
    :param num_dims: input dimension :math:`d`; if ``None`` it is inferred (and the
        random parameters drawn) at the first call, like ``RFFKernel``.
    :param nu: ``None`` for the RBF kernel, else the Matérn smoothness (0.5, 1.5 or 2.5).
    :param generator: optional :class:`torch.Generator` making the draw deterministic;
        otherwise torch's global RNG is used. Parameters are drawn in float64 on the
        generator's device (CPU without one) and then cast to the kernel's dtype/device.
    :param kwargs: passed to :class:`gpytorch.kernels.Kernel` (``ard_num_dims``,
        ``batch_shape``, ``lengthscale_prior``, ...). With a ``batch_shape`` the random
        parameters are drawn independently per batch member.

    Buffers (``*batch_shape x num_blocks x d'``, ``num_blocks = ceil(D / d')``):
    ``ff_signs`` (:math:`B`), ``ff_perm`` (:math:`\Pi`, int64 indices: :math:`(\Pi y)_i = y_{\pi(i)}`),
    ``ff_gauss`` (:math:`G`) and ``ff_scale`` (:math:`S`).
    """

    has_lengthscale = True

    def __init__(
        self,
        num_samples: int,
        num_dims: int | None = None,
        nu: float | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        num_samples = _positive_int("num_samples", num_samples)
        if num_dims is not None:
            num_dims = _positive_int("num_dims", num_dims, "or None")
        if nu is not None and (isinstance(nu, bool) or nu not in _SUPPORTED_NU):
            raise ValueError(f"FastfoodKernel: `nu` must be None (RBF) or one of {_SUPPORTED_NU}, got {nu!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"FastfoodKernel: `generator` must be a torch.Generator or None, got {type(generator)}")
        super().__init__(**kwargs)
        self.num_samples: int = num_samples
        self.num_dims: int | None = None
        self.nu: float | None = None if nu is None else float(nu)
        self.generator: torch.Generator | None = generator
        if num_dims is not None:
            self._init_weights(num_dims)

    # ------------------------------------------------------------------ sampling
    @property
    def padded_dims(self) -> int | None:
        """:math:`d'`, the next power of two >= ``num_dims`` (``None`` before initialisation)."""
        return None if self.num_dims is None else _next_power_of_two(self.num_dims)

    @property
    def num_blocks(self) -> int | None:
        """Number of stacked :math:`d' \\times d'` Fastfood blocks (``None`` before initialisation)."""
        dp = self.padded_dims
        return None if dp is None else -(-self.num_samples // dp)

    def _sample_chi2(self, shape: torch.Size, dof: int, device: torch.device) -> Tensor:
        """``shape`` iid chi^2_dof variables as sums of squared standard normals (float64)."""
        n = math.prod(shape)
        out = torch.empty(n, dtype=torch.float64, device=device)
        rows = max(1, _CHI_CHUNK // dof)
        for start, stop in row_blocks(n, rows):
            z = torch.randn(stop - start, dof, dtype=torch.float64, device=device, generator=self.generator)
            out[start:stop] = z.square().sum(-1)
        return out.reshape(shape)

    def _init_weights(self, num_dims: int) -> None:
        """Draw and register the Fastfood parameters for inputs of dimension ``num_dims``."""
        self.num_dims = int(num_dims)
        dp = _next_power_of_two(self.num_dims)
        nb = -(-self.num_samples // dp)
        shape = torch.Size([*self._batch_shape, nb, dp])
        g = self.generator
        dev = g.device if g is not None else torch.device("cpu")
        f64 = torch.float64

        signs = torch.randint(0, 2, shape, device=dev, generator=g).to(f64).mul_(2).sub_(1)
        perm = torch.rand(shape, dtype=f64, device=dev, generator=g).argsort(dim=-1)
        gauss = torch.randn(shape, dtype=f64, device=dev, generator=g)
        s = self._sample_chi2(shape, dp, dev).sqrt()  # chi_{d'} row norms
        if self.nu is not None:
            u = self._sample_chi2(shape, round(2 * self.nu), dev)
            s = s * torch.sqrt(2 * self.nu / u)
        scale = s / gauss.norm(dim=-1, keepdim=True)

        self._register_params(signs, perm, gauss, scale)

    def _register_params(self, signs: Tensor, perm: Tensor, gauss: Tensor, scale: Tensor) -> None:
        dtype, device = self.raw_lengthscale.dtype, self.raw_lengthscale.device
        self.register_buffer("ff_signs", signs.to(device=device, dtype=dtype))
        self.register_buffer("ff_perm", perm.to(device=device, dtype=torch.long))
        self.register_buffer("ff_gauss", gauss.to(device=device, dtype=dtype))
        self.register_buffer("ff_scale", scale.to(device=device, dtype=dtype))

    # ------------------------------------------------------------------ (de)serialisation
    def get_extra_state(self) -> dict:
        """Saved in ``state_dict`` so that a lazily constructed kernel (``num_dims=None``) can load it."""
        return {"num_dims": self.num_dims, "num_samples": self.num_samples, "nu": self.nu}

    def set_extra_state(self, state: dict) -> None:
        for key in ("num_samples", "nu"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"FastfoodKernel: state_dict has `{key}`={state.get(key)!r} "
                    f"but this kernel has {getattr(self, key)!r}"
                )
        num_dims = state.get("num_dims")
        if self.num_dims is not None and num_dims is not None and num_dims != self.num_dims:
            raise ValueError(
                f"FastfoodKernel: state_dict has `num_dims`={num_dims} but this kernel has {self.num_dims}"
            )
        if num_dims is not None:
            self.num_dims = int(num_dims)

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        extra = state_dict.get(prefix + "_extra_state")
        key = prefix + "ff_gauss"
        saved_dims = extra.get("num_dims") if isinstance(extra, dict) else None
        if self.num_dims is None and saved_dims is not None and key in state_dict:
            # lazily constructed kernel: create placeholder buffers of the saved shapes to load into
            shape = state_dict[key].shape
            empty = torch.zeros(shape)
            self._register_params(empty, empty.long(), empty, empty)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    # ------------------------------------------------------------------ features
    def _check_input(self, x: Tensor, name: str) -> None:
        if not x.is_floating_point():
            raise ValueError(f"FastfoodKernel: `{name}` must be a floating-point tensor, got dtype {x.dtype}")
        if x.size(-1) != self.num_dims:
            raise ValueError(
                f"FastfoodKernel: the last dimension of `{name}` ({x.size(-1)}) must equal num_dims ({self.num_dims})"
            )
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"FastfoodKernel: `{name}` contains {int((~torch.isfinite(x)).sum())} NaN or Inf value(s)")

    def _project(self, x: Tensor) -> Tensor:
        """``x @ V^T`` for ``x`` of shape ``(..., n, num_dims)``, shape ``(..., n, D)``.

        For ``d' <= 2048`` and ``n >= d'`` the ``num_dims x D`` matrix ``V^T`` is built by
        the structured transform of the identity (``O(D d' log d')``, no larger than the
        output) and applied with one matmul (``O(n D d)`` flops at BLAS speed); otherwise the
        structured transform runs on the data (``O(n D log d')``). Same numbers either way,
        up to rounding.
        """
        dp = self.padded_dims
        assert dp is not None
        if dp <= _DENSE_MAX_DIMS and x.size(-2) >= dp:
            eye = torch.eye(x.size(-1), dp, dtype=x.dtype, device=x.device)
            return x @ self._project_structured(eye)
        return self._project_structured(x)

    def _project_structured(self, x: Tensor) -> Tensor:
        """``x @ V^T`` through ``S H G Pi H B`` per block: O(n D log d')."""
        dp = self.padded_dims
        assert dp is not None
        if dp > x.size(-1):
            x = torch.nn.functional.pad(x, (0, dp - x.size(-1)))
        # the random parameters in x's dtype (as GPyTorch's kernels promote): FalkonGP evaluates K_MM in float64
        # with a float32 model's kernel
        signs, gauss, scale = (t.to(x.dtype) for t in (self.ff_signs, self.ff_gauss, self.ff_scale))
        y = x.unsqueeze(-2) * signs.unsqueeze(-3)  # (..., n, nb, d')  B x
        y = fwht(y)  # H B x
        y = torch.gather(y, -1, self.ff_perm.unsqueeze(-3).expand(y.shape))  # Pi H B x
        y = fwht(y * gauss.unsqueeze(-3))  # H G Pi H B x
        y = y * (scale.unsqueeze(-3) / math.sqrt(dp))  # S H G Pi H B x / sqrt(d')
        return y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])[..., : self.num_samples]

    def _featurize(self, x: Tensor, normalize: bool = False) -> Tensor:
        """Features ``[cos(V x / l), sin(V x / l)]`` of shape ``(..., n, 2 num_samples)``; divided by
        ``sqrt(num_samples)`` if ``normalize``."""
        if self.num_dims is None:
            self._init_weights(x.size(-1))
        self._check_input(x, "x")
        # divide each time so gradients flow to the (possibly ARD) lengthscale
        proj = self._project(x / self.lengthscale)
        z = torch.cat([torch.cos(proj), torch.sin(proj)], dim=-1)
        if normalize:
            z = z / math.sqrt(self.num_samples)
        return z

    def frequencies(self) -> Tensor:
        """The frequency matrix :math:`V` (``*batch_shape x num_samples x num_dims``, lengthscale excluded),
        built densely from the stored parameters with explicit Hadamard/permutation matrices.

        For tests and debugging only: it costs O(num_samples d') memory and
        O(num_samples d'^2) time; :meth:`forward` never forms it.
        """
        if self.num_dims is None:
            raise RuntimeError("FastfoodKernel: parameters not initialised yet (pass num_dims or call the kernel)")
        dp = self.padded_dims
        assert dp is not None
        dtype, device = self.ff_gauss.dtype, self.ff_gauss.device
        h = _sylvester_hadamard(dp, dtype, device)
        perm_mat = torch.eye(dp, dtype=dtype, device=device)[self.ff_perm]  # P[i, pi(i)] = 1
        hb = h * self.ff_signs.unsqueeze(-2)  # H diag(B)
        v = h @ (self.ff_gauss.unsqueeze(-1) * (perm_mat @ hb))  # H G P H B
        v = v * (self.ff_scale.unsqueeze(-1) / math.sqrt(dp))
        v = v.reshape(*v.shape[:-3], -1, dp)
        return v[..., : self.num_samples, : self.num_dims]

    # ------------------------------------------------------------------ kernel
    def forward(
        self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **kwargs: Any
    ) -> Tensor:
        if last_dim_is_batch:
            x1 = x1.transpose(-1, -2).unsqueeze(-1)
            x2 = x2.transpose(-1, -2).unsqueeze(-1)
        if self.num_dims is None:
            self._init_weights(x1.size(-1))
        self._check_input(x1, "x1")
        self._check_input(x2, "x2")
        x1_eq_x2 = torch.equal(x1, x2)
        # always normalised features (1/sqrt(D)), as RFFKernel (needed by LinearPredictionStrategy)
        z1 = self._featurize(x1, normalize=True)
        z2 = z1 if x1_eq_x2 else self._featurize(x2, normalize=True)
        if diag:
            return (z1 * z2).sum(-1)
        if x1_eq_x2:
            if z1.size(-1) < z2.size(-2):
                return LowRankRootLinearOperator(z1)
            return RootLinearOperator(z1)
        return MatmulLinearOperator(z1, z2.transpose(-1, -2))

    def prediction_strategy(
        self, train_inputs: Any, train_prior_dist: Any, train_labels: Any, likelihood: Any
    ) -> exact_prediction_strategies.PredictionStrategy:
        # finite-dimensional features: same fast strategy as RFFKernel
        return exact_prediction_strategies.LinearPredictionStrategy(
            train_inputs, train_prior_dist, train_labels, likelihood
        )
