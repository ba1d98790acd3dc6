"""The objectives as GPyTorch marginal-log-likelihood objects (for ``fit_gpytorch_mll`` and GPyTorch loops).

:class:`NystromMarginalLogLikelihood` wraps one :mod:`gpfalkon.objectives` objective as a
:class:`gpytorch.mlls.MarginalLogLikelihood`: ``mll(output, train_y) = (-T + log-priors) / (n t)`` with ``T`` the
objective as a total over the observations (``observation_total``: the value of a sum, ``n`` or ``n t`` times a mean)
(per observation, with the log-priors of the parameters for the SGPR bound, as GPyTorch's MLLs). The ``output``
argument (the model's train-mode output) is not used: every objective reads the model's kernel, penalty, centers and
training data itself. So both

.. code-block:: python

    mll = NystromMarginalLogLikelihood(model.likelihood, model, objective="sgpr")
    botorch.fit.fit_gpytorch_mll(mll)                 # L-BFGS-B (or a torch optimizer)

    for _ in range(steps):                            # an ordinary GPyTorch loop
        loss = -mll(model(train_x), train_y); loss.backward(); opt.step()

learn the kernel's parameters, ``lambda`` (the likelihood's noise ``n lambda``) and, with
``learn_centers=True``, the centers. Switching the MLL (hence the model) to eval mode refits the
model by FALKON when its hyperparameters changed, so ``fit_gpytorch_mll``, which ends with
``mll.eval()``, leaves a model whose posterior is ready.

Written here because GPyTorch's MLLs evaluate the exact likelihood of the model's train-mode
output (the ``n x n`` prior): for a Nyström model that is the wrong objective at ``O(n^3)``.
"""
from __future__ import annotations

from typing import Any

import torch
from gpytorch.mlls import MarginalLogLikelihood
from torch import Tensor

from .base import NystromObjective
from .exact import GCV, LOOCV, CompReg, HoldOut, NystromCompReg, SGPRBound
from .stochastic import StochasticNystromCompReg

__all__ = ["OBJECTIVE_NAMES", "NystromMarginalLogLikelihood"]

#: the names ``objective=`` accepts
OBJECTIVE_NAMES: dict[str, type[NystromObjective]] = {
    "sgpr": SGPRBound,
    "gcv": GCV,
    "compreg": CompReg,
    "nystrom-compreg": NystromCompReg,
    "loocv": LOOCV,
    "holdout": HoldOut,
    "stochastic-nystrom-compreg": StochasticNystromCompReg,
}


class NystromMarginalLogLikelihood(MarginalLogLikelihood):
    """``(-objective() [+ sum of log-priors]) / (n t)`` as a GPyTorch MLL (see the module docstring), with
    ``objective()`` as a total over the observations (:meth:`~gpfalkon.objectives.base.NystromObjective
    .observation_total`: GCV's and LOOCV's means over rows times ``n``, HoldOut's mean times ``n t``).

    As in GPyTorch's ``ExactMarginalLogLikelihood``, the result is per observation (divided by
    ``n t`` for ``t`` outputs) and, for the SGPR bound (a bound on the log marginal likelihood),
    the log-densities of the priors registered on the model's and likelihood's parameters (and any
    added loss terms) are added before the division: maximising it is MAP estimation. The other
    objectives are validation errors or regularised risks, to which log-priors do not belong:
    their priors are not added unless ``add_priors=True``.

    Args:
        likelihood: the model's likelihood (``model.likelihood``).
        model: a :class:`~gpfalkon.FalkonGP` (or :class:`~gpfalkon.botorch.FalkonModel`).
        objective: a name in :data:`OBJECTIVE_NAMES` (default ``"sgpr"``: the Titsias bound,
            whose value per point is GPyTorch SGPR's loss), an objective class, or an objective
            built on ``model``.
        refit: refit the model by FALKON when the MLL goes to eval mode (default ``True``).
        add_priors: add the parameters' log-priors (default: for the SGPR bound only).
        objective_kwargs: options of the objective class (``num_trace_vectors``, ...).
    """

    def __init__(self, likelihood: Any, model: Any, objective: str | type[NystromObjective] | NystromObjective = "sgpr",
                 *, refit: bool = True, add_priors: bool | None = None, **objective_kwargs: Any) -> None:
        super().__init__(likelihood, model)
        if likelihood is not getattr(model, "likelihood", None):
            raise ValueError("likelihood must be the model's own likelihood (model.likelihood)")
        if isinstance(objective, NystromObjective):
            if objective_kwargs:
                raise ValueError("objective_kwargs apply when the objective is given by name or class")
            if objective.model is not model:
                raise ValueError("objective: an objective built on another model")
            obj = objective
        else:
            cls = OBJECTIVE_NAMES.get(objective) if isinstance(objective, str) else objective
            if not (isinstance(cls, type) and issubclass(cls, NystromObjective)):
                raise ValueError(f"objective must be one of {sorted(OBJECTIVE_NAMES)}, a NystromObjective class or "
                                 f"instance, got {objective!r}")
            obj = cls(model, **objective_kwargs)
        self.objective = obj
        self.refit = bool(refit)
        # log-priors belong with a (bound on the) negative log-likelihood, i.e. a MAP objective; added
        # to a validation error (GCV, LOOCV, HoldOut) or a complexity-regularised risk they would mix
        # units and, on O(1) errors, dominate them
        self.add_priors = isinstance(obj, SGPRBound) if add_priors is None else bool(add_priors)

    def forward(self, function_dist: Any, target: Tensor, *params: Any, **kwargs: Any) -> Tensor:
        """``(-observation_total(objective()) [+ log-priors]) / (n t)``; ``target`` must be the model's training targets
        (the objective is computed on them)."""
        want = self.model.train_targets
        if not isinstance(target, Tensor) or target.numel() != want.numel():
            raise ValueError(
                f"target: the objective is computed on the model's training targets ({tuple(want.shape)}); "
                f"got {tuple(getattr(target, 'shape', ()))} (use model.set_train_data to change the data)"
            )
        if target is not want and (target.dtype != want.dtype or target.device != want.device
                                   or not torch.equal(target.detach().reshape(want.shape), want.detach())):
            # O(n), against the objective's O(n M^2): other targets of the same size (re-standardised, permuted,
            # a minibatch) would otherwise be ignored without a word
            raise ValueError(
                "target: the objective is computed on the model's training targets, and these differ from them "
                "(in value, dtype or device); use model.set_train_data to train on other targets"
            )
        res = -self.objective.observation_total(self.objective())
        # as GPyTorch's exact MLL: added loss terms and the log-priors of the model's (and its
        # likelihood's) parameters, e.g. BoTorch's LogNormal noise prior, then per observation
        for term in self.model.added_loss_terms():
            res = res + term.loss(*params)
        if self.add_priors:
            for _, module, prior, closure, _ in self.model.named_priors():
                res = res + prior.log_prob(closure(module)).sum()
        return res / (self.model.n * self.model.num_outputs)

    def train(self, mode: bool = True) -> NystromMarginalLogLikelihood:
        super().train(mode)
        if not mode and self.refit:
            model = self.model
            if not bool(model.fitted) or model._hyper_changed():
                with torch.no_grad():
                    model.fit()
        return self
