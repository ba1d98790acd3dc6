"""Classification by Nyström kernel ridge regression on coded targets (FALKON paper, Sec. 5).

Labels are coded as regression targets and fitted by one FALKON solve with one
right-hand side per output:

* two classes ``{c0, c1}``: ``y = -1`` for ``c0``, ``+1`` for ``c1``; decision ``sign(f(x))``;
* ``k > 2`` classes: one-hot ``Y`` (``n x k``, ``Y_ic = 1`` if ``label_i = c``, else 0),
  ``k`` right-hand sides in the same CG run; decision ``argmax_c f_c(x)``.

This is what the FALKON paper does on SUSY / HIGGS (binary, +-1) and TIMIT
(one-hot). The scores ``f(x) = K_xM alpha`` are the posterior mean of the
underlying :class:`~gpfalkon.FalkonGP`; they are not probabilities. Cost: one
FALKON fit with ``t = 1`` or ``k`` right-hand sides (``O(n M (d + t))`` per CG
iteration) and ``O(q M (d + t))`` to score ``q`` points.
"""
from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from ..backend.passes import is_sharded
from .falkon_gp import FalkonGP

__all__ = ["FalkonClassifier", "encode_labels"]


def encode_labels(
    labels: Tensor, classes: Tensor | None = None, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """Coded targets for ``labels`` (``(n,)`` integer or float class labels).

    Returns ``(targets, classes)``: ``classes`` are the sorted distinct labels (or the
    given ones, which must be 1-D, strictly increasing, i.e. sorted and distinct);
    ``targets`` is ``(n,)`` in ``{-1, +1}`` for two classes (``+1`` = ``classes[1]``), or
    ``(n, k)`` one-hot for ``k > 2`` classes. Boolean labels are coded as ``0 / 1``
    (``int64`` classes).
    """
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.is_complex():
        raise TypeError(f"labels must be real (integer, float or bool), got dtype {labels.dtype}")
    if labels.dtype == torch.bool:
        labels = labels.long()
    if labels.dim() != 1:
        raise ValueError(f"labels must be 1-D (n,), got shape {tuple(labels.shape)}")
    if labels.numel() == 0 and classes is None:  # with given classes an empty shard codes to nothing
        raise ValueError("labels is empty")
    if labels.is_floating_point() and not bool(torch.isfinite(labels).all()):
        raise ValueError("labels contains NaN or Inf values")
    if classes is None:
        if labels.is_floating_point() and not bool((labels == labels.round()).all()):
            raise ValueError(
                "labels are floats with non-integer values (continuous targets?): FalkonClassifier needs class "
                "labels; pass classes= to use such values as classes, or FalkonGP for regression"
            )
        classes = torch.unique(labels)
    else:
        if not isinstance(classes, Tensor):
            raise TypeError(f"classes must be a torch.Tensor, got {type(classes).__name__}")
        if classes.dtype == torch.bool:
            classes = classes.long()
        if classes.dim() != 1:
            raise ValueError(f"classes must be 1-D, got shape {tuple(classes.shape)}")
        if classes.numel() > 1 and not bool((classes[1:] > classes[:-1]).all()):
            raise ValueError("classes must be strictly increasing (sorted, no duplicates)")
        if classes.is_floating_point() and not labels.is_floating_point():  # compare as floats, keep float classes
            as_float = labels.to(classes.dtype)
            if not bool((as_float.to(labels.dtype) == labels).all()):  # (2049 in float16 is 2048: another class)
                raise ValueError(f"labels cannot be held exactly in the classes' dtype {classes.dtype}: give labels "
                                 "and classes one dtype")
            labels = as_float
        cast = classes.to(device=labels.device, dtype=labels.dtype)
        back = cast.to(classes.dtype).to(classes.device)
        if not bool((back == classes).all()):
            raise ValueError(f"classes cannot be held exactly in the labels' dtype {labels.dtype} (got "
                             f"{classes.tolist()[:8]}...): give labels and classes one dtype")
        classes = cast
    if classes.numel() < 2:
        raise ValueError(f"labels must contain at least 2 classes, got {classes.numel()}")
    pos = torch.searchsorted(classes, labels)
    pos_c = pos.clamp(max=classes.numel() - 1)
    if bool((classes[pos_c] != labels).any()):
        raise ValueError("labels contains values not in classes")
    if classes.numel() == 2:
        targets = pos_c.to(dtype) * 2 - 1
    else:
        targets = torch.nn.functional.one_hot(pos_c, classes.numel()).to(dtype)
    return targets, classes


class FalkonClassifier(torch.nn.Module):
    r"""Binary / multiclass classifier: a :class:`~gpfalkon.FalkonGP` on coded labels.

    ``FalkonClassifier(train_x, labels, kernel, **falkon_kwargs).fit()`` fits
    ``H alpha = K_Mn Y`` (``Y``: +-1 column or one-hot, see :func:`encode_labels`) with
    FALKON; :meth:`decision_function` returns ``K_xM alpha`` and :meth:`predict` the
    class (sign / argmax). ``falkon_kwargs`` go to :class:`~gpfalkon.FalkonGP`
    (``num_centers``, ``penalty``, ``max_iter``, ``tol``, ...); the GP is ``self.model``.
    ``classes`` fixes the class list (default: the distinct labels; with a sharded backend,
    the distinct labels of all ranks).
    """

    classes: Tensor  # a buffer
    model: FalkonGP

    def __init__(self, train_x: Tensor, labels: Tensor, kernel: Kernel | None = None, *,
                 classes: Tensor | None = None, **falkon_kwargs) -> None:
        super().__init__()
        if not isinstance(train_x, Tensor):
            raise TypeError(f"train_x must be a torch.Tensor, got {type(train_x).__name__}")
        if not isinstance(labels, Tensor):
            raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
        if labels.dim() == 1 and train_x.dim() == 2 and labels.shape[0] != train_x.shape[0]:
            raise ValueError(f"labels has {labels.shape[0]} entries but train_x has {train_x.shape[0]} rows")
        backend = getattr(falkon_kwargs.get("options"), "backend", None)
        if classes is None and is_sharded(backend):
            # a shard may miss some classes: code the labels against the classes of all ranks
            classes = backend.distinct_values(labels)
        targets, classes = encode_labels(labels, classes, dtype=train_x.dtype)
        self.register_buffer("classes", classes.to(train_x.device).clone())
        self.model = FalkonGP(train_x, targets.to(train_x.device), kernel, **falkon_kwargs)

    @property
    def num_classes(self) -> int:
        return int(self.classes.numel())

    def _apply(self, fn, *args, **kwargs):
        # .to(dtype) / .float() / .half() convert the model, never the class labels (a float32 copy of the float64
        # label 16777217. is another label): they keep their dtype and follow the device only
        classes = self.classes
        super()._apply(fn, *args, **kwargs)
        self.classes = classes.to(device=self.classes.device)
        return self

    def fit(self, **fit_kwargs) -> FalkonClassifier:
        """Fit the underlying GP (``fit_kwargs`` go to :meth:`FalkonGP.fit`); returns ``self``."""
        self.model.fit(**fit_kwargs)
        return self

    def decision_function(self, x: Tensor) -> Tensor:
        """Scores ``f(x) = K_xM alpha``: ``(q,)`` for two classes, ``(q, k)`` otherwise."""
        self.model.eval()
        return self.model.posterior_mean(x)

    def predict(self, x: Tensor) -> Tensor:
        """Predicted labels ``(q,)``: ``classes[1]`` where the score is > 0 (two classes), else the argmax class."""
        scores = self.decision_function(x)
        if self.num_classes == 2:
            return self.classes[(scores > 0).long()]
        return self.classes[scores.argmax(-1)]
