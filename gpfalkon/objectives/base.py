"""Shared machinery of the hyperparameter objectives (Meanti et al. 2022; docs/math.md §5).

Every exact objective is a function of a few ``O(M^2)`` aggregates of the data,
accumulated over row blocks of ``K_nM`` (docs/math.md §5.1):

    L L^T = K_MM (+ jitter),   A = L^{-1} K_Mn,   B = I + A A^T / v,   L_B L_B^T = B,

    A A^T (M x M),  A y (M x t),  tr(K~) = ||A||_F^2,  tr(K_nn) = sum_i k(x_i, x_i).

Each block's contribution is computed under :func:`torch.utils.checkpoint`, so
autograd keeps no per-block graph: memory is ``O(M^2 + block x M)`` whatever
``n``, and the backward pass recomputes each block once. Cost: ``O(n M^2)`` for
the forward pass and about twice that for the backward pass.
"""
from __future__ import annotations

import abc
import contextlib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import settings
from .._validation import all_finite
from ..backend.blocks import AGGREGATE, block_rows_for
from ..backend.passes import backend_pass, is_sharded, reduce_rows
from ..backend.stationary_grad import grad_kernel_block
from ..linalg import jittered_cholesky
from ..models.fit_state import kernel_identity

__all__ = ["NystromAggregates", "NystromObjective"]


@dataclass
class NystromAggregates:
    """The differentiable ``O(M^2)`` summaries of the data (see module docstring)."""

    L: Tensor  # (M, M) lower Cholesky factor of K_MM (+ jitter)
    AAt: Tensor  # (M, M)
    AY: Tensor  # (M, t)
    tr_ktilde: Tensor  # ()
    tr_knn: Tensor  # ()
    yy: Tensor  # (t,)  ||y||^2 per column
    n: int


class NystromObjective(torch.nn.Module, metaclass=abc.ABCMeta):
    """Base class: ``objective()`` returns the scalar to *minimise* at the model's
    current kernel, penalty and centers, on its training data.

    Args:
        model: a :class:`~gpfalkon.FalkonGP` (its ``kernel``, ``centers``,
            ``penalty`` and training data are used; nothing is copied, so gradients
            reach the model's parameters).
        block_rows: rows per block of the blockwise pass (default
            :class:`gpfalkon.settings.block_rows`, or 2048 when that is automatic;
            capped by the model's ``memory_budget``, :mod:`gpfalkon.backend.blocks`).
    """

    def __init__(self, model, *, block_rows: int | None = None) -> None:
        super().__init__()
        if not (hasattr(model, "nystrom_operator") and hasattr(model, "train_inputs")):
            raise TypeError(f"model must be a FalkonGP (or FalkonModel), got {type(model).__name__}")
        self.model = model
        if block_rows is not None and int(block_rows) < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        self.block_rows = block_rows

    # ----------------------------------------------------------------- data
    def _data(self) -> tuple[Tensor, Tensor]:
        x = self.model.train_inputs[0]
        centered = getattr(self.model, "centered_targets", None)
        if centered is not None:  # y - mean_constant
            return x, centered()
        y = self.model.train_targets
        return x, (y.unsqueeze(-1) if y.dim() == 1 else y)

    def _rows(self, n: int) -> int:
        """Block height of the aggregate passes (:data:`~gpfalkon.backend.AGGREGATE`), within
        the model's ``memory_budget``."""
        c = self.model.centers
        return block_rows_for(
            n,
            c.shape[0],
            torch.finfo(c.dtype).bits // 8,
            AGGREGATE,
            memory_budget=getattr(self.model, "memory_budget", None),
            block_rows=self.block_rows,
            device=c.device,
            d=c.shape[-1],
        )

    # --------------------------------------------------------------- pieces
    def cholesky_kmm(self) -> Tensor:
        """Differentiable lower Cholesky factor of ``K_MM + j I``, computed in float64
        and returned in the data dtype. The first jitter is FALKON's ``eps M mean(diag K_MM)``
        with the data dtype's ``eps``; where that factorisation fails, the jitter is chosen
        (without gradient) by :func:`jittered_cholesky` (duplicate centers escalate it, with a
        warning) and the factor recomputed. Cost ``O(M^3 / 3)``: one factorisation when the
        first jitter succeeds (the usual case), the search and one more otherwise.

        So a float32 model's objectives are those of ``K_MM + j_32 I``, not of the ``K_MM`` its fit solves with: at
        a small penalty and a long lengthscale their values and gradients differ from float64's (GCV at
        ``lambda = 1e-8``: gradients of the other sign; 40 Adam steps on kin40k and synthetic sets still ended at
        float64's hyperparameters, test RMSE within 0.3 %). Learn in float64 where the objective itself matters."""
        kernel, c = self.model.kernel, self.model.centers
        kmm = grad_kernel_block(kernel, c, c)
        kmm64 = kmm.to(torch.float64)  # factor in float64 whatever the data dtype
        # first jitter: FALKON's eps * M with the eps of the *data* dtype, since the
        # blocks A = L^{-1} K_Mb are then solved in that dtype
        m = kmm.shape[-1]
        first = float(torch.finfo(kmm.dtype).eps) * m * float(kmm64.detach().diagonal().abs().mean())
        eye = torch.eye(m, dtype=torch.float64, device=kmm.device)
        # the factor of jittered_cholesky's first try, under autograd: where it succeeds, the search is not needed
        L, info = torch.linalg.cholesky_ex(kmm64 + first * eye)
        if int(info) == 0 and all_finite(L.detach()):
            return L.to(kmm.dtype)
        _, jit = jittered_cholesky(kmm64.detach(), upper=False, name="K_MM", jitter=first)
        return torch.linalg.cholesky(kmm64 + jit * eye).to(kmm.dtype)

    def aggregates(self, x: Tensor, y: Tensor, L: Tensor) -> NystromAggregates:
        """``A A^T``, ``A y``, ``tr(K~)`` and ``tr(K_nn)``: one backend pass
        (:func:`~gpfalkon.backend.passes.whitened_aggregates`)."""
        with self._pass_budget():
            agg = self.backend_pass("whitened_aggregates")(
                self.model.kernel, x, y, self.model.centers, L, self._rows(x.shape[0])
            )
        yy, n = self.reduce(y.square().sum(0), torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device))
        return NystromAggregates(
            L=L, AAt=agg.AAt, AY=agg.AY, tr_ktilde=agg.tr_ktilde, tr_knn=agg.tr_knn, yy=yy, n=int(n)
        )

    def for_each_block(
        self, x: Tensor, L: Tensor, fn: Callable[[Tensor, int, int], Tensor]
    ) -> list[Tensor]:
        """Apply ``fn(A_b, start, stop)`` to every block ``A_b = L^{-1} K_Mb`` (checkpointed where the whole
        graph exceeds its share of the memory budget: :func:`~gpfalkon.backend.keeps_graph`)."""
        with self._pass_budget():
            return self.backend_pass("map_whitened_blocks")(
                self.model.kernel, x, self.model.centers, L, fn, self._rows(x.shape[0])
            )

    def _pass_budget(self) -> contextlib.AbstractContextManager[Any]:
        """The model's own ``memory_budget``, where it has one, as :class:`gpfalkon.settings.memory_budget`
        while a pass runs: a pass gets its block height from :meth:`_rows` and decides from the setting
        whether its whole graph fits (:func:`~gpfalkon.backend.keeps_graph`), so both follow the model's budget."""
        budget = getattr(self.model, "memory_budget", None)
        return settings.memory_budget(budget) if budget is not None else contextlib.nullcontext()

    @property
    def backend(self) -> Any | None:
        """The model's data backend (``model.options.backend``; ``None``: in memory)."""
        return getattr(getattr(self.model, "options", None), "backend", None)

    def backend_pass(self, name: str) -> Callable:
        """The data pass ``name`` of the model's backend (``model.options.backend``), else the in-memory one."""
        return backend_pass(self.backend, name)

    def reduce(self, *tensors: Tensor, anchor: Tensor | None = None) -> list[Tensor]:
        """Sums over this process's rows completed over every shard (identity in one process;
        a differentiable collective with a sharded backend: every rank must call it)."""
        return reduce_rows(self.backend, *tensors, anchor=anchor)

    @staticmethod
    def cholesky_b(agg: NystromAggregates, v: Tensor) -> Tensor:
        """``L_B = chol(I + A A^T / v)`` (eigenvalues >= 1: no jitter needed)."""
        m = agg.AAt.shape[-1]
        eye = torch.eye(m, dtype=agg.AAt.dtype, device=agg.AAt.device)
        return torch.linalg.cholesky(eye + agg.AAt / v)

    @staticmethod
    def smoother_terms(agg: NystromAggregates, LB: Tensor, v: Tensor) -> dict:
        """``tr(S)``, ``y^T S y``, ``||S y||^2`` (per column) and ``W`` with ``S y = A^T W``."""
        m = LB.shape[-1]
        eye = torch.eye(m, dtype=LB.dtype, device=LB.device)
        lb_inv = torch.linalg.solve_triangular(LB, eye, upper=False)
        # tr(S) = tr(B^{-1} A A^T) / v = tr(B^{-1} (B - I)) = M - ||L_B^{-1}||_F^2
        tr_s = m - lb_inv.square().sum()
        z = lb_inv @ agg.AY  # L_B^{-1} A y
        ysy = z.square().sum(0) / v
        w = lb_inv.mT @ z / v  # B^{-1} A y / v
        sy_sq = (w * (agg.AAt @ w)).sum(0)  # ||A^T w||^2
        return {"tr_s": tr_s, "ysy": ysy, "sy_sq": sy_sq, "w": w, "z": z}

    # ---------------------------------------------------------------- API
    @abc.abstractmethod
    def objective(self) -> Tensor:
        """The objective's value (a differentiable scalar)."""

    def observation_total(self, value: Tensor) -> Tensor:
        """``value`` as a total over the ``n t`` observations, which
        :class:`~gpfalkon.objectives.NystromMarginalLogLikelihood` divides by ``n t`` as GPyTorch's MLLs do: the
        value itself for the objectives that are sums over rows (the SGPR bound, the complexity-regularised
        risks); a mean over rows is multiplied back (else it would be divided by ``n`` twice, and an optimiser's
        gradient tolerance, e.g. L-BFGS-B's in ``fit_gpytorch_mll``, met at the start)."""
        return value

    def check_state(self) -> None:
        """Raise ``ValueError`` naming what is not finite: the penalty, a kernel parameter, the centers
        or the training data (edited in place after the model was built). ``O(n d)``, against the
        objective's ``O(n M^2)``."""
        model = self.model
        pen = model.penalty.detach()
        if not bool(torch.isfinite(pen).all()) or not bool((pen > 0).all()):
            constraint = getattr(getattr(getattr(model, "likelihood", None), "noise_covar", None),
                                 "raw_noise_constraint", None)
            hint = ""
            if constraint is not None and getattr(constraint, "enforced", True) is False:
                # BoTorch's likelihoods: a bound without a transform, kept by fit_gpytorch_mll's bounded optimiser
                hint = (f"; the likelihood's noise constraint ({type(constraint).__name__}) applies no transform, so a "
                        "torch optimiser can step past its bound: fit with botorch's fit_gpytorch_mll, or clamp the "
                        "raw noise after each step")
            raise ValueError(f"penalty is {pen.tolist()} (noise {getattr(model, 'noise', pen).detach().tolist()}): "
                             f"it must be finite and > 0 (a too-large optimiser step, or a NaN noise?){hint}")
        for name, p in model.kernel.named_parameters():
            if not bool(torch.isfinite(p.detach()).all()):
                raise ValueError(f"kernel parameter {name} is not finite: {p.detach().tolist()}")
        if not bool(torch.isfinite(model.centers.detach()).all()):
            raise ValueError("centers contain NaN or Inf")
        x, y = self._data()
        bad = torch.tensor([float(not all_finite(y.detach())),
                            float(isinstance(x, Tensor) and not all_finite(x.detach()))],
                           dtype=torch.float64, device=model.centers.device)
        (bad,) = self.reduce(bad)  # a collective with a sharded backend: every rank learns of a bad shard
        for flag, name in zip(bad.tolist(), ("train_y", "train_x"), strict=True):
            if flag:
                raise ValueError(f"{name} contains NaN or Inf (was it edited in place after the model was built?)")

    def forward(self) -> Tensor:
        """The objective's value; with a sharded backend, evaluated on the joint graph of all
        ranks so that every rank gets the single-process gradients
        (:meth:`~gpfalkon.backend.distributed.DistributedBackend.joint_objective`). Call the
        module (``loss = objective()``), not :meth:`objective`, in a distributed run.
        Raises ``ValueError`` naming a non-finite penalty, kernel parameter, center or datum
        (:meth:`check_state`)."""
        self.check_state()
        joint = getattr(self.backend, "joint_objective", None)
        if is_sharded(self.backend) and callable(joint):
            check = getattr(self.backend, "check_consistent", None)
            if callable(check):
                # ranks whose hyperparameters differ (set after construction on one rank) would sum kernel blocks
                # of different kernels into a value of neither model, and drift apart step by step: one all_gather
                m = self.model
                c = m.centers.detach()
                check(centers=c, penalty=m.penalty.detach(), mean_constant=m.mean_constant,
                      **kernel_identity(m.kernel, c.device))
            return joint(self, self.objective)
        return self.objective()

    def minimize(self, steps: int, lr: float = 0.05, optimizer: torch.optim.Optimizer | None = None) -> list[float]:
        """Run ``steps`` optimiser steps on the model's parameters (Adam with ``lr`` unless
        ``optimizer`` is given; each step through a closure, so optimisers that evaluate the objective
        several times a step, such as ``torch.optim.LBFGS``, work too); returns the objective value at the
        start of each step. A non-finite objective or parameter restores the parameters to their values
        before the step that caused it and raises ``ValueError``. The usual GPyTorch loop works just as
        well: this is the loop, written once."""
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        if optimizer is None and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                                  or not math.isfinite(lr) or lr <= 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = optimizer if optimizer is not None else torch.optim.Adam(params, lr=lr)
        values: list[float] = []
        before: list[Tensor] | None = None  # the parameters before the last step

        def restore(to: list[Tensor]) -> None:
            with torch.no_grad():
                for p, b in zip(params, to, strict=True):
                    p.copy_(b)

        evaluations = [0]  # of the current step

        def closure() -> Tensor:
            # every evaluation an optimiser asks for (Adam: one a step; LBFGS: its line search's too)
            opt.zero_grad()
            loss = self()
            if not bool(torch.isfinite(loss.detach())):
                raise ValueError(f"the objective is {float(loss.detach())}")
            loss.backward()
            evaluations[0] += 1
            return loss

        for i in range(int(steps)):
            start = [p.detach().clone() for p in params]
            evaluations[0] = 0
            try:
                loss = opt.step(closure)
            except ValueError as exc:
                if evaluations[0] > 0:  # the step's own evaluations left the finite region
                    restore(start)
                    raise ValueError(f"minimize: during step {i} (lr={lr!r}): {exc}; the parameters are restored "
                                     "to their values before that step") from exc
                if before is None:  # the state was bad before any step of this call
                    raise
                restore(before)
                raise ValueError(f"minimize: after step {i - 1} (lr={lr!r}): {exc}; the parameters are restored to "
                                 "their values before that step") from exc
            before = start
            bad = [name for name, p in self.model.named_parameters() if p.requires_grad
                   and not bool(torch.isfinite(p.detach()).all())]
            if bad:
                restore(before)
                raise ValueError(
                    f"minimize: step {i} made {', '.join(bad)} NaN or Inf (lr={lr!r} too large?); the parameters "
                    "are restored to their values before that step"
                )
            values.append(float(loss.detach()))
        return values

    @staticmethod
    def log2pi() -> float:
        return math.log(2 * math.pi)
