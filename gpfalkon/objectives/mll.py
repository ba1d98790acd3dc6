"""The objectives as GPyTorch marginal-log-likelihood objects (for ``fit_gpytorch_mll`` and GPyTorch loops).

:class:`NystromMarginalLogLikelihood` wraps one :mod:`gpfalkon.objectives` objective as a
:class:`gpytorch.mlls.MarginalLogLikelihood`: ``mll(output, train_y) = (-objective() + log-priors) / n``
(per data point, with the log-priors of the parameters, as GPyTorch's MLLs). The ``output``
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

from typing import Any, Dict, Type, Union

import torch
from gpytorch.mlls import MarginalLogLikelihood
from torch import Tensor

from .base import NystromObjective
from .exact import GCV, LOOCV, CompReg, HoldOut, NystromCompReg, SGPRBound
from .stochastic import StochasticNystromCompReg

__all__ = ["NystromMarginalLogLikelihood", "OBJECTIVE_NAMES"]

#: the names ``objective=`` accepts
OBJECTIVE_NAMES: Dict[str, Type[NystromObjective]] = {
    "sgpr": SGPRBound,
    "gcv": GCV,
    "compreg": CompReg,
    "nystrom-compreg": NystromCompReg,
    "loocv": LOOCV,
    "holdout": HoldOut,
    "stochastic-nystrom-compreg": StochasticNystromCompReg,
}


class NystromMarginalLogLikelihood(MarginalLogLikelihood):
    """``(-objective() + sum of log-priors) / n`` as a GPyTorch MLL (see the module docstring).

    As in GPyTorch's ``ExactMarginalLogLikelihood``, the log-densities of the priors registered
    on the model's and likelihood's parameters (and any added loss terms) are added before the
    division by ``n``: a model without priors gets ``-objective() / n``.

    Args:
        likelihood: the model's likelihood (``model.likelihood``).
        model: a :class:`~gpfalkon.FalkonGP` (or :class:`~gpfalkon.botorch.FalkonModel`).
        objective: a name in :data:`OBJECTIVE_NAMES` (default ``"sgpr"``: the Titsias bound,
            whose value per point is GPyTorch SGPR's loss), an objective class, or an objective
            built on ``model``.
        refit: refit the model by FALKON when the MLL goes to eval mode (default ``True``).
        objective_kwargs: options of the objective class (``num_trace_vectors``, ...).
    """

    def __init__(self, likelihood: Any, model: Any, objective: Union[str, Type[NystromObjective], NystromObjective] = "sgpr",
                 *, refit: bool = True, **objective_kwargs: Any) -> None:
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

    def forward(self, function_dist: Any, target: Tensor, *params: Any, **kwargs: Any) -> Tensor:
        """``-objective() / n``; ``target`` must be the model's training targets (the objective is
        computed on them)."""
        want = self.model.train_targets
        if not isinstance(target, Tensor) or target.numel() != want.numel():
            raise ValueError(
                f"target: the objective is computed on the model's training targets ({tuple(want.shape)}); "
                f"got {tuple(getattr(target, 'shape', ()))} (use model.set_train_data to change the data)"
            )
        res = -self.objective()
        # as GPyTorch's exact MLL: added loss terms and the log-priors of the model's (and its
        # likelihood's) parameters, e.g. BoTorch's LogNormal noise prior, then per data point
        for term in self.model.added_loss_terms():
            res = res + term.loss(*params)
        for _, module, prior, closure, _ in self.model.named_priors():
            res = res + prior.log_prob(closure(module)).sum()
        return res / self.model.n

    def train(self, mode: bool = True) -> "NystromMarginalLogLikelihood":
        super().train(mode)
        if not mode and self.refit:
            model = self.model
            if not bool(model.fitted) or model._hyper_changed():
                with torch.no_grad():
                    model.fit()
        return self
