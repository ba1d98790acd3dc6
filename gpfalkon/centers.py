"""Choice of the Nyström centers (inducing points).

* :func:`uniform_centers` / :class:`UniformCenters`: ``M`` training rows drawn
  uniformly *without* replacement (FALKON, Alg. 1), skipping rows equal to one drawn before
  (:func:`first_distinct`); preconditioner weights ``D = I``.
* :func:`leverage_centers` / :class:`LeverageCenters`: ``M`` draws *with*
  replacement with probabilities proportional to approximate ridge leverage
  scores (FALKON, appendix A), duplicates merged into counts, and the diagonal
  weights ``D`` of the generalised preconditioner (docs/math.md §3.1, §3.3).
* :func:`approximate_leverage_scores`: the scores themselves, by BLESS-R
  (Rudi, Calandriello, Carratino, Rosasco, NeurIPS 2018), in ``O(n M_J^2)`` time
  and ``O(n + M_J^2)`` memory, ``M_J = O(d_eff)`` the size of BLESS's dictionary.
* :func:`dictionary_leverage_scores`: the scores from a given dictionary (e.g. uniformly
  drawn centers), one pass in ``O(n M_J^2)``.
* :func:`nested_leverage_centers` / :class:`NestedLeverageCenters`: one stream of leverage
  draws whose first ``m`` distinct rows are the centers at every size ``m`` (nested, with
  the weights ``D`` of each size).
* :func:`effective_dimension`: ``d_eff(lambda) = sum_i l_i(lambda)``.

Ridge leverage scores (docs/math.md §3.3), with ``K = K_nn``:

    l_i(lambda) = ( K (K + n lambda I)^{-1} )_ii,     d_eff(lambda) = sum_i l_i(lambda).

They measure how much point ``i`` matters for the regularised problem at
``lambda``: ``K_ii / (tr K + n lambda) <= l_i <= K_ii / (K_ii + n lambda) <= 1``.
Sampling centers proportionally to them needs only ``M ~ d_eff log d_eff`` centers
for FALKON's preconditioned system to be well conditioned, whatever the data
distribution; uniform sampling needs ``M ~ n max_i l_i`` (up to ``1 / lambda``),
which is much more when the data are clustered or have outliers.
"""
from __future__ import annotations

import copy
import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from ._validation import (
    check_center_weights,
    check_count,
    check_dtype,
    check_generator,
    check_inputs,
    check_kernel,
    check_num_centers,
    check_penalty,
    check_positive_real,
    check_scores,
)
from ._warn import warn_caller
from .backend.blocks import FACTOR, block_rows_for
from .backend.passes import backend_pass, is_sharded, total_rows
from .errors import JitterWarning
from .linalg import jittered_cholesky

__all__ = [
    "CenterSelection",
    "CenterSelector",
    "FixedCenters",
    "LeverageCenters",
    "NestedLeverageCenters",
    "UniformCenters",
    "approximate_leverage_scores",
    "dictionary_leverage_scores",
    "distinct_groups",
    "effective_dimension",
    "first_distinct",
    "leverage_centers",
    "merge_repeated_scores",
    "nested_leverage_centers",
    "uniform_centers",
]


@dataclass
class CenterSelection:
    """Selected centers and how they were chosen.

    Attributes:
        centers: ``(M, d)`` rows of the training inputs (``M`` distinct rows).
        indices: ``(M,)`` training-row indices of the centers (sorted).
        weights: ``(M,)`` diagonal of the preconditioner weights ``D`` (float64),
            ``None`` meaning ``D = I`` (uniform sampling). Pass them to
            :class:`~gpfalkon.NystromKRROperator` / :class:`~gpfalkon.FalkonGP`
            (``weights=`` / ``center_weights=``).
        counts: ``(M,)`` how many of the with-replacement draws fell on each center
            (leverage sampling; ``None`` for uniform sampling).
        probabilities: ``(M,)`` sampling probability ``p_j`` of each center (float64;
            leverage sampling).
    """

    centers: Tensor
    indices: Tensor | None = None
    weights: Tensor | None = None
    counts: Tensor | None = None
    probabilities: Tensor | None = None


def _rand(num: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """``num`` float64 uniforms from ``generator`` (its own device), moved to ``device``."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(num, generator=generator, dtype=torch.float64, device=gen_device).to(device)


#: the most rows :func:`uniform_centers` reads, as a multiple of ``num_centers``, looking for distinct rows
DISTINCT_DRAWS = 16


def first_distinct(rows: Tensor) -> Tensor:
    """``(R,)`` bool: ``True`` where ``rows[i]`` is the first row with its values (rows compared exactly, all
    ``d`` values). ``O(R d log R)`` time (a sort), ``O(R d)`` memory.

    Why: a center equal to another adds nothing to the Nyström span ``{k(., z_j)}`` (the fit and its error are
    those of the distinct centers), costs as much as a new one in every pass and leaves ``K_MM`` singular (the
    preconditioner's Cholesky then needs jitter). Data with repeated rows (rounded or categorical features) give
    such centers under uniform draws; torch has no order-keeping ``unique``, hence this mask."""
    return _value_groups(rows)[0]


def _value_groups(rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(keep, inverse)``: :func:`first_distinct`'s mask and ``torch.unique``'s group of each row (one sort)."""
    r = int(rows.shape[0])
    if r == 0:
        empty = torch.zeros(0, dtype=torch.long, device=rows.device)
        return empty.bool(), empty
    _, inverse = torch.unique(rows.reshape(r, -1), dim=0, return_inverse=True)
    pos = torch.arange(r, device=rows.device)
    first = torch.full((int(inverse.max()) + 1,), r, dtype=torch.long, device=rows.device)
    first.scatter_reduce_(0, inverse, pos, reduce="amin")
    return first[inverse] == pos, inverse


def _check_distinct(distinct: object) -> None:
    if not isinstance(distinct, bool):
        raise TypeError(f"distinct must be a bool, got {type(distinct).__name__}")


def distinct_groups(rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(keep, to)`` for ``R`` rows: ``keep = first_distinct(rows)`` and, for each row, the position among the
    kept rows (in order) of the first row with its values, so that ``rows[keep][to] == rows`` and a sum over equal
    rows is ``zeros(keep.sum()).index_add_(0, to, values)``. ``O(R d log R)``."""
    keep, inverse = _value_groups(rows)
    if bool(keep.all()):
        return keep, torch.arange(int(rows.shape[0]), device=rows.device)
    slot = torch.full((int(inverse.max()) + 1,), -1, dtype=torch.long, device=rows.device)
    slot[inverse[keep]] = torch.arange(int(keep.sum()), device=rows.device)
    return keep, slot[inverse]


def merge_repeated_scores(x: Tensor, scores: Tensor) -> Tensor:
    """``scores`` with each distinct row's scores summed onto its first row of ``x`` and zero on the rows that
    repeat it (:func:`first_distinct`). A draw with probabilities proportional to the result picks a value of
    ``x`` as often as one proportional to ``scores`` does, and never two rows of one value: the Nyström sketch of
    ``K`` is unchanged in distribution (equal rows have equal columns) and its distinct centers are more.
    ``O(n d log n)``, float64 result. ``x`` holds all the rows (one process: equal rows on two ranks of a sharded
    backend would not be found)."""
    check_scores("scores", scores, int(x.shape[0]))
    keep, to = distinct_groups(x)
    keep, to = keep.to(scores.device), to.to(scores.device)
    total = torch.zeros(int(keep.sum()), dtype=torch.float64, device=scores.device).index_add_(
        0, to, scores.detach().to(torch.float64))
    return torch.where(keep, total[to], torch.zeros((), dtype=torch.float64, device=scores.device))


def uniform_centers(
    x: Tensor, num_centers: int, generator: torch.Generator | None = None, backend: Any | None = None,
    *, distinct: bool = True,
) -> CenterSelection:
    """Sample ``num_centers`` rows of ``x`` uniformly without replacement, distinct in value by default.

    ``distinct=True``: the rows are taken in the order of one random permutation, skipping a row equal to one
    taken before (:func:`first_distinct`), until ``num_centers`` are taken; at most ``DISTINCT_DRAWS *
    num_centers`` rows are read (in doublings from ``num_centers``), and where fewer distinct rows turn up the
    centers are those (with a ``UserWarning`` where that limit, not the end of ``x``, stopped the search). Data
    without repeated rows give the same centers as ``distinct=False``, the plain draw (FALKON, Alg. 1): the first
    ``num_centers`` rows of the permutation.

    Cost O(n) time and memory for the permutation, plus ``O(R d log R)`` for the ``R`` rows read; deterministic
    given ``generator``. With a sharded ``backend`` (:class:`~gpfalkon.backend.distributed.DistributedBackend`)
    ``x`` is this rank's shard: the indices are drawn over the *global* rows (so the centers
    do not depend on the number of ranks) and gathered from the shards that hold them
    (one ``all_reduce`` of the rows each doubling adds, ``R x d`` values in all); ``indices`` are global row
    indices.
    """
    sharded = is_sharded(backend)
    check_inputs("train_x", x, allow_empty=sharded)
    n = total_rows(backend, x)
    num_centers = check_num_centers(num_centers, n)
    check_generator(generator)
    _check_distinct(distinct)
    device = generator.device if generator is not None else torch.device("cpu")
    perm = torch.randperm(n, generator=generator, device=device)

    def rows_of(idx: Tensor) -> Tensor:
        if sharded:
            assert backend is not None  # is_sharded(None) is False
            return backend.gather_rows(x, idx)
        return x[idx]

    take = num_centers
    idx = perm[:take].to(x.device)
    rows = rows_of(idx)
    while distinct:
        keep = first_distinct(rows)
        if int(keep.sum()) >= num_centers or take >= min(n, DISTINCT_DRAWS * num_centers):
            idx, rows = idx[keep][:num_centers], rows[keep][:num_centers]
            break
        # the next doubling reads (and, sharded, gathers) only the rows it adds
        more = perm[take:min(n, DISTINCT_DRAWS * num_centers, 2 * take)].to(x.device)
        take += int(more.numel())
        idx, rows = torch.cat([idx, more]), torch.cat([rows, rows_of(more)])
    if idx.numel() < num_centers and take < n:
        warn_caller(f"num_centers={num_centers}: only {idx.numel()} distinct rows among the {take:,} of x "
                      f"drawn (at most {DISTINCT_DRAWS} num_centers are read); the centers are those {idx.numel()} "
                      "(a repeated center adds nothing to the fit; distinct=False draws the rows as they come)",
                      UserWarning)
    order = torch.argsort(idx)
    return CenterSelection(centers=rows[order].clone(), indices=idx[order])


@runtime_checkable
class CenterSelector(Protocol):
    """The one call signature of every center choice (uniform, leverage scores, given centers):

        selector(x, num_centers, kernel=None, penalty=None) -> CenterSelection

    ``kernel`` and ``penalty`` are the model's at selection time (leverage scores depend on
    both; uniform sampling and given centers ignore them). ``num_centers=None`` asks for the
    selector's default (``min(n, 1000)`` for sampling; all of them for given centers). Learning the centers afterwards
    is the model's business (``FalkonGP(learn_centers=True)`` makes them a parameter).
    """

    def __call__(
        self, x: Tensor, num_centers: int | None, kernel: Kernel | None = None, penalty: float | Tensor | None = None
    ) -> CenterSelection:
        ...


def default_num_centers(x: Tensor, backend: Any | None = None, n: int | None = None) -> int:
    """``min(n, 1000)``: the number of centers drawn when none is asked for (``n`` over all
    shards for a sharded ``backend``; pass ``n`` when it is known, to save the collective)."""
    return min(total_rows(backend, x) if n is None else int(n), 1000)


def _generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(0 if seed is None else int(seed))
    check_generator(generator)
    return generator


class UniformCenters:
    """Center selector: ``M`` rows drawn uniformly without replacement, distinct in value unless
    ``distinct=False`` (:func:`uniform_centers`)."""

    def __init__(self, seed: int | None = None, generator: torch.Generator | None = None,
                 backend: Any | None = None, *, distinct: bool = True) -> None:
        self.generator = _generator(seed, generator)
        self.backend = backend
        _check_distinct(distinct)
        self.distinct = distinct

    def __call__(
        self, x: Tensor, num_centers: int | None, kernel: Kernel | None = None, penalty: float | Tensor | None = None
    ) -> CenterSelection:
        m = default_num_centers(x, self.backend) if num_centers is None else num_centers
        return uniform_centers(x, m, self.generator, backend=self.backend, distinct=self.distinct)


class FixedCenters:
    """Center selector that returns given centers (and optional preconditioner weights ``D``)."""

    def __init__(self, centers: Tensor, weights: Tensor | None = None) -> None:
        check_dtype("centers", centers)
        if centers.dim() != 2 or centers.shape[0] == 0:
            raise ValueError(f"centers must have shape (M, d) with M >= 1, got {tuple(centers.shape)}")
        if weights is not None:
            check_center_weights("center_weights", weights, centers.shape[0], centers.device)
        self.centers = centers.detach().clone()
        self.weights = None if weights is None else weights.detach().to(torch.float64).clone()

    def __call__(
        self, x: Tensor, num_centers: int | None, kernel: Kernel | None = None, penalty: float | Tensor | None = None
    ) -> CenterSelection:
        if num_centers is not None and num_centers != self.centers.shape[0]:
            raise ValueError(f"num_centers={num_centers} but {self.centers.shape[0]} centers were given")
        if self.centers.dtype != x.dtype:
            raise TypeError(f"centers has dtype {self.centers.dtype} but train_x has {x.dtype}")
        if self.centers.device != x.device:
            raise ValueError(f"centers is on {self.centers.device} but train_x is on {x.device}")
        check_inputs("centers", self.centers, d=x.shape[1])
        return CenterSelection(
            centers=self.centers.clone(), weights=None if self.weights is None else self.weights.clone()
        )


# --------------------------------------------------------------- leverage scores
def _kernel64(kernel: Kernel) -> Kernel:
    """``kernel`` itself if all its floating tensors are float64, else a float64 copy
    (the scores need float64 kernel values: ``K_ii - K_iJ G^{-1} K_Ji`` cancels)."""
    tensors = itertools.chain(kernel.parameters(), kernel.buffers())
    if all(t.dtype == torch.float64 for t in tensors if t.is_floating_point()):
        return kernel
    return copy.deepcopy(kernel).to(torch.float64)


def _dense(t) -> Tensor:
    return t if isinstance(t, Tensor) else t.to_dense()


def _rows_per_block(m: int, n: int, block_rows: int | None, device: torch.device | None = None) -> int:
    """Row-block height of the leverage-score passes (float64, ``O(M_J^2)`` work per row) on ``device``."""
    return block_rows_for(n, m, 8, FACTOR, block_rows=block_rows, device=device)


def _kernel_diag(kernel64: Kernel, x: Tensor, rows: int, backend: Any | None = None) -> Tensor:
    """``K_ii`` for all rows of ``x`` (float64, ``O(n d)``): one backend pass."""
    with torch.no_grad():
        diag = backend_pass(backend, "kernel_diagonal")(kernel64, x, rows, dtype=torch.float64)
        return _dense(diag).to(torch.float64)


class _Rows:
    """The rows the leverage scores are computed on: all of ``x``, or (with a sharded backend)
    this rank's shard of the global rows. The sums, maxima, gathers and concatenations the
    algorithms need are then over all shards (collectives); in one process they are local.
    Every random draw is made for the *global* rows, so the result does not depend on the
    number of ranks."""

    def __init__(self, x: Tensor, backend: Any | None) -> None:
        self.sharded = is_sharded(backend)
        self.backend: Any = backend  # not None where self.sharded
        self.n_local = int(x.shape[0])
        if self.sharded:
            assert backend is not None  # is_sharded(None) is False
            self.offset, _, self.n = backend.row_range(x)
            self.rank = backend.rank
        else:
            self.offset, self.n, self.rank = 0, self.n_local, 0

    def sum(self, value: Tensor | float) -> float:
        if not self.sharded:
            return float(value)
        t = torch.as_tensor(value, dtype=torch.float64).reshape(1)
        return float(self.backend.reduce_nograd(t.to(self.backend._device()))[0])

    def max(self, value: float) -> float:
        return self.backend.maximum(value) if self.sharded else float(value)

    def counts(self, k: int) -> list[int]:
        return self.backend.counts(k) if self.sharded else [int(k)]

    def concat(self, t: Tensor) -> Tensor:
        return self.backend.concat(t).to(t.device) if self.sharded else t

    def gather(self, x: Tensor, indices: Tensor) -> Tensor:
        """``X_global[indices]`` (global row indices)."""
        return self.backend.gather_rows(x, indices) if self.sharded else x[indices]

    def draws(self, count: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
        """This shard's part of ``count = n`` global uniforms (all of them in one process)."""
        return _rand(count, generator, device)[self.offset : self.offset + self.n_local]

    def values_at(self, values: Tensor, indices: Tensor) -> Tensor:
        """``v_global[indices]`` of a per-row float64 vector (``values``: this shard's rows)."""
        if not self.sharded:
            return values[indices]
        out = torch.zeros(indices.numel(), dtype=torch.float64, device=values.device)
        mine = (indices >= self.offset) & (indices < self.offset + self.n_local)
        out[mine] = values[indices[mine] - self.offset].to(torch.float64)
        return self.backend.reduce_nograd(out)


class _Dictionary:
    """A weighted BLESS dictionary ``J`` (training-row indices) with ``A = diag(a_j)``,
    ``a_j`` the probability with which ``j`` entered it (Bernoulli sampling), and the
    Nyström leverage-score estimator it defines (BLESS, Eq. 5 with ``A = S^{-2}``):

        l~_J(i, lambda) = ( K_ii - K_iJ (K_JJ + n lambda A)^{-1} K_Ji ) / (n lambda).

    This is ``phi_i^T (C~ + n lambda)^{-1} phi_i`` with ``C~ = sum_{j in J} phi_j phi_j^T / a_j``,
    an unbiased sketch of ``C = sum_i phi_i phi_i^T`` (``phi`` the feature map), so it
    is within a constant factor of ``l_i`` once ``C~`` approximates ``C`` to a constant
    factor relative to ``n lambda`` (a dictionary of ``O(d_eff log n)`` points).
    """

    def __init__(self, indices: Tensor, probs: Tensor) -> None:
        self.indices = indices
        self.probs = probs

    @property
    def size(self) -> int:
        return int(self.indices.numel())

    def scores(
        self,
        kernel64: Kernel,
        x: Tensor,
        rows_idx: Tensor | None,
        lam_n: float,
        diag: Tensor,
        trace: float,
        block_rows: int | None,
        backend: Any | None = None,
        rows_info: _Rows | None = None,
    ) -> Tensor:
        """Estimated ``l_i`` for ``i`` in ``rows_idx`` (``None``: all rows), float64.

        ``self.indices`` are global row indices; ``rows_idx``, ``diag`` and the result refer to
        this process's rows (``rows_info``: the sharding, default all of ``x``).

        Cost ``O(M_J^3)`` for the factorisation plus ``O(r M_J (M_J + d))`` for ``r``
        rows (kernel block, triangular solve), in row blocks: memory ``O(rows M_J + M_J^2)``.
        The result is clipped to the interval every exact score lies in,
        ``[K_ii / (tr K + n lambda), K_ii / (K_ii + n lambda)]``.
        """
        d_i = diag if rows_idx is None else diag[rows_idx]
        count = int(d_i.numel())
        if self.size == 0:
            est = d_i / lam_n
        else:
            xj = (rows_info.gather(x, self.indices) if rows_info is not None else x[self.indices]).to(torch.float64)
            g = _dense(kernel64(xj, xj)).to(torch.float64)
            g = g + torch.diag(lam_n * self.probs)
            with warnings.catch_warnings():
                # jitter only perturbs sampling probabilities: no need to alarm the user
                warnings.simplefilter("ignore", JitterWarning)
                chol, _ = jittered_cholesky(g, upper=False, name="K_JJ + n lambda A (BLESS dictionary)")
            rows = _rows_per_block(self.size, max(count, 1), block_rows, device=x.device)
            if count > 0:
                norms = backend_pass(backend, "whitened_sq_norms")(kernel64, x, xj, chol, rows, indices=rows_idx)
            else:  # no rows to score on this shard
                norms = torch.zeros(0, dtype=torch.float64, device=d_i.device)
            est = (d_i - norms) / lam_n
        upper = d_i / (d_i + lam_n)
        lower = d_i / (trace + lam_n)
        return torch.minimum(torch.maximum(est, lower), upper)


def approximate_leverage_scores(
    x: Tensor,
    kernel: Kernel,
    penalty: float | Tensor,
    *,
    generator: torch.Generator | None = None,
    oversampling: float = 5.0,
    lambda_step: float = 2.0,
    max_dictionary_size: int = 2048,
    min_dictionary_size: int = 128,
    block_rows: int | None = None,
    backend: Any | None = None,
) -> Tensor:
    r"""Approximate ridge leverage scores ``l_i(lambda) = (K (K + n lambda I)^{-1})_ii`` by BLESS-R.

    Algorithm (BLESS-R, Rudi, Calandriello, Carratino, Rosasco, NeurIPS 2018, Alg. 2),
    with ``q = lambda_step``, ``q2 = oversampling``, ``kappa^2 = max_i K_ii``:

    * ``lambda_h = kappa^2 / q^h``, ``h = 1, 2, ...`` while above ``lambda``, then
      ``lambda`` itself (``log_q(kappa^2 / lambda)`` levels); dictionary ``J_0`` empty.
    * Level ``h``: candidates ``U_h``: each row independently with probability
      ``beta_i = min(c_h K_ii / (K_ii + n lambda_h), 1)`` (an upper bound on
      ``c_h l_i(lambda_h)``), ``c_h = max(q2, min_dictionary_size / d^_h)`` with
      ``d^_h`` an upper estimate of ``d_eff(lambda_h)`` (``q`` times the previous
      level's Horvitz-Thompson estimate); their scores ``l~_{J_{h-1}}(i, lambda_h)`` from the
      previous dictionary (accurate at ``lambda_{h-1} = q lambda_h``, hence within
      a factor ``q`` more at ``lambda_h``), with the estimator

          l~_J(i, lambda) = ( K_ii - K_iJ (K_JJ + n lambda A)^{-1} K_Ji ) / (n lambda),
          A = diag(a_j), a_j = probability that j entered J;

      then ``J_h``: each candidate kept with probability ``p_i / beta_i``,
      ``p_i = min(c_h l~_i, beta_i)``, so ``i`` is in ``J_h`` with probability ``p_i``
      and ``|J_h| ~ c_h d_eff(lambda_h)``.
    * Finally one blockwise pass scores all ``n`` rows with ``J_H`` at ``lambda``.

    Why BLESS-R. Against BLESS with replacement (the paper's Alg. 1): same
    guarantee and cost, but the dictionary is a set of distinct rows with Bernoulli
    inclusion probabilities, so ``K_JJ`` has no duplicate rows (no numerically
    singular factorisation) and the weights ``A`` need no counts. Against recursive
    RLS-Nyström (Musco & Musco 2017): both need a dictionary of ``O(d_eff log n)``
    points and ``O(n M_J^2)`` time, but the recursion computes scores on nested
    uniform halvings of the data at the *final* ``lambda`` at every level, while
    BLESS walks down in ``lambda`` with small candidate sets
    (``~ q2 kappa^2 / lambda_h``) until ``lambda_h`` nears ``kappa^2 / n``, and
    every level's dictionary is only ever used at a ``lambda`` within a factor ``q``
    of the one it was built for. Determinism: every random draw (the ``n`` Bernoulli
    candidates and the acceptances of each level) comes from ``generator`` in a fixed
    order, so the scores are a deterministic function of its state.

    Guarantee (Rudi et al. 2018, main theorem, for BLESS and BLESS-R): for
    ``q2 >= c log(n H / delta)`` (``c`` depending on the accuracy ``t``), with
    probability ``>= 1 - delta``, at every level ``l_i / T <= l~_i <= T l_i`` for all
    ``i`` with a constant ``T = T(t)``, and
    ``|J_h| = O(q2 d_eff(lambda_h))``. The theoretical constants
    are pessimistic; in practice (RBF, n = 1000, d = 3, lambda in [1e-5, 1e-3],
    20 seeds, defaults ``q2 = 5``, ``min_dictionary_size = 128``) at least 94 % of
    the ratios ``l~_i / l_i`` lie in ``[1/2, 2]`` and at least 98.5 % in ``[1/3, 3]``;
    ``sum_i l~_i`` overestimates ``d_eff`` by 1-22 %. Harder cases (smoother kernel
    relative to the data, d_eff ~ 20-60) keep ~95 % of the ratios in ``[1/3, 3]``
    with a few points off by up to 4-5x (``tests/test_centers.py`` checks the
    first case against dense exact scores). What is implemented is a
    *multiplicative* approximation (no additive term); the estimates are also
    clipped to the interval holding every exact score,
    ``[K_ii / (tr K + n lambda), K_ii / (K_ii + n lambda)]``.

    ``min_dictionary_size`` raises the oversampling of a level whose expected
    dictionary would be smaller (cheap: ``O(n * 128^2)``), which makes small
    ``d_eff`` (< 30) markedly more accurate.

    Cost: ``O(n M_J^2 + n M_J d)`` for the final pass plus, per level, ``O(|U_h| M_{J,h-1}^2)``
    and ``n`` uniform draws; ``|U_h| = n`` once ``n lambda_h < q2 kappa^2``, so for
    ``lambda << kappa^2 / n`` the ``log_q(q2 kappa^2 / (n lambda))`` last levels are
    full passes: ``O(n M_J^2 log(1 / (n lambda)))`` in that regime. ``M_J <= max_dictionary_size``.
    Memory ``O(n + M_J^2 + rows M_J)``: never an ``n x M`` (let alone ``n x n``) matrix;
    kernel values are computed per row block of ``x`` cast to float64 (a float64
    copy of ``kernel`` when its parameters are float32), and all linear algebra is
    float64 (:func:`~gpfalkon.linalg.jittered_cholesky`).

    Args:
        x: ``(n, d)`` inputs.
        kernel: a GPyTorch kernel (single output, no batch dimensions).
        penalty: ``lambda > 0`` (FALKON's normalisation: ``H = K_Mn K_nM + n lambda K_MM``).
        generator: ``torch.Generator`` for all random draws: the result is a
            deterministic function of its state (default: torch's global generator).
        oversampling: ``q2``, the dictionary oversampling factor (``>= 1``); accuracy
            and cost (``O(q2^2)``) grow with it.
        min_dictionary_size: oversample more at levels where ``q2 d_eff(lambda_h)``
            is below this (0 disables it).
        lambda_step: ``q > 1``, the ratio of consecutive ``lambda_h``.
        max_dictionary_size: cap on ``E|J_h|``; when ``q2 d_eff(lambda_h)`` exceeds it
            the inclusion probabilities are scaled down (still an unbiased sketch,
            less accurate) and a ``RuntimeWarning`` says so.
        block_rows: rows per kernel block (default: about 8 MiB of float64 values).
        backend: an injected data backend whose ``kernel_diagonal`` / ``whitened_sq_norms``
            passes replace the in-memory ones (:func:`~gpfalkon.backend.passes.backend_pass`).

    Returns:
        ``(n,)`` float64 tensor of approximate leverage scores, each in ``(0, 1]``
        unless ``K_ii = 0``.
    """
    rows_info = _Rows(x, backend)
    check_inputs("x", x, allow_empty=rows_info.sharded)
    check_kernel(kernel)
    check_penalty(penalty)
    check_generator(generator)
    q2 = check_positive_real("oversampling", oversampling, minimum=1.0)
    q = check_positive_real("lambda_step", lambda_step, minimum=1.0, strict_minimum=True)
    max_dict = check_count("max_dictionary_size", max_dictionary_size, 1)
    min_dict = min(check_count("min_dictionary_size", min_dictionary_size, 0), max_dict)
    lam = float(torch.as_tensor(penalty).detach())
    n = rows_info.n  # all shards' rows
    k64 = _kernel64(kernel)
    capped_at: float | None = None
    with torch.no_grad():
        if rows_info.n_local > 0:
            diag = _kernel_diag(k64, x, _rows_per_block(1, rows_info.n_local, block_rows, device=x.device), backend)
        else:
            diag = torch.zeros(0, dtype=torch.float64, device=x.device)
        if not bool(torch.isfinite(diag).all()) or bool((diag < 0).any()):
            raise ValueError("kernel: k(x_i, x_i) must be finite and >= 0 on x (is the kernel positive definite?)")
        trace = rows_info.sum(diag.sum())
        kappa2 = rows_info.max(float(diag.max()) if diag.numel() else float("-inf"))
        if kappa2 == 0.0:
            raise ValueError("kernel: k(x_i, x_i) = 0 for every row of x, so all leverage scores are 0")
        levels = []
        lam_h = kappa2
        while lam_h / q > lam * (1 + 1e-12):
            lam_h /= q
            levels.append(lam_h)
        levels.append(lam)
        dictionary = _Dictionary(
            torch.empty(0, dtype=torch.long, device=x.device), torch.empty(0, dtype=torch.float64, device=x.device)
        )
        d_prev: float | None = None  # estimate of d_eff at the previous level
        for lam_h in levels:
            lam_n = lam_h * n
            bound = diag / (diag + lam_n)  # l_i <= bound_i
            # d_eff(lambda_h) <= q d_eff(lambda_{h-1}) and <= sum(bound): oversample more when
            # the dictionary would otherwise hold fewer than min_dictionary_size points
            bound_sum = rows_info.sum(bound.sum())
            d_hat = bound_sum if d_prev is None else min(bound_sum, q * d_prev)
            c = max(q2, min_dict / max(d_hat, 1e-300))
            beta = (c * bound).clamp_(max=1.0)
            cand = torch.nonzero(rows_info.draws(n, generator, x.device) < beta).squeeze(-1)  # local indices
            cand_counts = rows_info.counts(cand.numel())
            if sum(cand_counts) == 0:
                dictionary = _Dictionary(cand, torch.empty(0, dtype=torch.float64, device=x.device))
                d_prev = None
                continue
            est = dictionary.scores(k64, x, cand, lam_n, diag, trace, block_rows, backend, rows_info)
            beta_c = beta[cand]
            d_prev = rows_info.sum((est / beta_c).sum())  # Horvitz-Thompson estimate of sum_i l~_i
            p = torch.minimum(c * est, beta_c)
            total = rows_info.sum(p.sum())
            if total > max_dict:
                p = p * (max_dict / total)
                capped_at = lam_h
            # one draw per candidate of the global (rank-ordered) candidate list
            first = sum(cand_counts[: rows_info.rank])
            keep_u = _rand(sum(cand_counts), generator, x.device)[first : first + cand.numel()]
            keep = keep_u < p / beta_c
            new_idx = cand[keep] + rows_info.offset  # global row indices
            dictionary = _Dictionary(rows_info.concat(new_idx.to(torch.float64)).round().to(torch.long),
                                     rows_info.concat(p[keep]))
        scores = dictionary.scores(k64, x, None, lam * n, diag, trace, block_rows, backend, rows_info)
    if capped_at is not None:
        warn_caller(
            f"approximate_leverage_scores: the BLESS dictionary was capped at max_dictionary_size="
            f"{max_dict} (q2 * d_eff exceeded it from lambda_h = {capped_at:.3g} on); the scores are less "
            "accurate. Raise max_dictionary_size (cost O(n M_J^2)) or the penalty.",
            RuntimeWarning,
        )
    return scores


def _check_row_indices(name: str, idx: object, n: int) -> None:
    """Raise unless ``idx`` is a 1-D integer tensor of row indices in ``[0, n)`` (``name`` in the message)."""
    if not isinstance(idx, Tensor) or idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be a 1-D integer tensor of row indices")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"{name}: row indices must lie in [0, {n}), got [{int(idx.min())}, {int(idx.max())}]")


def dictionary_leverage_scores(
    x: Tensor,
    kernel: Kernel,
    penalty: float | Tensor,
    dictionary: Tensor,
    inclusion: float | Tensor,
    *,
    block_rows: int | None = None,
    rows: Tensor | None = None,
) -> Tensor:
    r"""Ridge leverage scores of the rows of ``x`` estimated from a given dictionary ``J``:

        l~_i = ( K_ii - K_iJ (K_JJ + n lambda A)^{-1} K_Ji ) / (n lambda),   A = diag(a_j),

    ``a_j`` the probability with which row ``j`` entered ``J`` (``inclusion``). For ``J`` drawn
    uniformly without replacement, ``a_j = M_J / n``; the estimator is then the Nystrom one of
    the sketch ``C~ = (n / M_J) sum_{j in J} phi_j phi_j^T`` (:func:`approximate_leverage_scores`
    builds ``J`` by BLESS instead, over ``log(kappa^2 / lambda)`` levels). With ``J`` all rows and
    ``a = 1`` it is exact: ``(K (K + n lambda I)^{-1})_ii``. Estimates are clipped to
    ``[K_ii / (tr K + n lambda), K_ii / (K_ii + n lambda)]``, the interval of every exact score.

    Why: a model fitted with ``M`` uniform centers has its dictionary already; one pass over the
    rows (``O(n M_J (M_J + d) + M_J^3)`` time, float64, row blocks: ``O(rows M_J + M_J^2)`` memory)
    gives scores to draw leverage-score centers from, where BLESS's levels would cost several
    passes.

    Args:
        x: ``(n, d)`` inputs (one process; no sharded backend).
        kernel: a GPyTorch kernel (evaluated in float64).
        penalty: ``lambda > 0``.
        dictionary: ``(M_J,)`` distinct row indices of ``x``.
        inclusion: ``a_j`` in ``(0, 1]``, a number or an ``(M_J,)`` tensor.
        block_rows: rows per kernel block (default: about 8 MiB of float64 values).
        rows: 1-D integer indices of the rows to score (default: all): the full result's entries at
            ``rows``, up to rounding (``n``, ``lambda`` and ``tr K`` stay those of all of ``x``; the blocks of
            the pass may differ),
            for the pass's ``O(|rows| M_J (M_J + d))`` part; the ``O(M_J^3)`` factorisation and the
            ``O(n d)`` diagonal are computed again at each call.

    Returns:
        ``(n,)`` float64 scores, or ``(len(rows),)`` with ``rows``.
    """
    check_inputs("x", x)
    check_kernel(kernel)
    check_penalty(penalty)
    n = int(x.shape[0])
    _check_row_indices("dictionary", dictionary, n)
    if int(torch.unique(dictionary).numel()) != int(dictionary.numel()):
        raise ValueError("dictionary: row indices must be distinct")
    a = torch.as_tensor(inclusion, dtype=torch.float64, device=x.device).detach()
    if a.dim() == 0:
        a = a.expand(dictionary.numel())
    if a.shape != dictionary.shape:
        raise ValueError(f"inclusion must be a number or have shape {tuple(dictionary.shape)}, got {tuple(a.shape)}")
    if not bool(torch.isfinite(a).all()) or bool((a <= 0).any()) or bool((a > 1).any()):
        raise ValueError("inclusion: probabilities must lie in (0, 1]")
    if rows is not None:
        _check_row_indices("rows", rows, n)
        rows = rows.to(x.device).long()
    lam = float(torch.as_tensor(penalty).detach())
    k64 = _kernel64(kernel)
    with torch.no_grad():
        diag = _kernel_diag(k64, x, _rows_per_block(1, n, block_rows, device=x.device))
        if not bool(torch.isfinite(diag).all()) or bool((diag < 0).any()):
            raise ValueError("kernel: k(x_i, x_i) must be finite and >= 0 on x (is the kernel positive definite?)")
        trace = float(diag.sum())
        if trace == 0.0:
            raise ValueError("kernel: k(x_i, x_i) = 0 for every row of x, so all leverage scores are 0")
        return _Dictionary(dictionary.to(x.device).long(), a.clone()).scores(
            k64, x, rows, lam * n, diag, trace, block_rows)


@dataclass
class NestedLeverageCenters:
    """Nested leverage-score centers: one stream of ``R`` draws with replacement with
    probabilities ``p`` (:func:`nested_leverage_centers`); the centers of size ``m`` are the
    first ``m`` distinct rows in order of first draw, and their weights are those of
    :func:`leverage_centers` for the draws up to the ``m``-th new row, ``r_m`` of them:

        D_jj = sqrt( m count_j(r_m) / (n r_m p_j) ),

    ``count_j(r_m)`` the draws of row ``j`` among the first ``r_m``. So every size is a
    leverage-score sample of its own (``r_m`` i.i.d. draws, duplicates merged), and a larger size
    contains a smaller one, as uniform centers drawn from one permutation do.

    Attributes:
        indices: ``(L,)`` distinct rows in order of first draw (``L <= R``).
        first_draw: ``(L,)`` position in the stream of each one's first draw (increasing).
        stream: ``(R,)`` the draws.
        probabilities: ``(n,)`` sampling probabilities ``p`` (float64).
    """

    indices: Tensor
    first_draw: Tensor
    stream: Tensor
    probabilities: Tensor

    @property
    def size(self) -> int:
        """``L``, the largest size available."""
        return int(self.indices.numel())

    def select(self, x: Tensor, m: int) -> CenterSelection:
        """The ``m`` first distinct rows of ``x`` (the rows the probabilities are over) and their
        weights ``D``; ``O(n + r_m + m d)`` (the weights index the ``(n,)`` probabilities)."""
        n = int(self.probabilities.numel())
        if x.shape[0] != n:
            raise ValueError(f"x has {x.shape[0]} rows; the draws are over {n}")
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= self.size:
            raise ValueError(f"m must be an int in [1, {self.size}], got {m!r}")
        r = int(self.first_draw[m - 1]) + 1
        idx = self.indices[:m]
        rank = torch.full((n,), -1, dtype=torch.long, device=idx.device)
        rank[idx] = torch.arange(m, device=idx.device)
        drawn = rank[self.stream[:r]]
        counts = torch.bincount(drawn, minlength=m)
        p = self.probabilities[idx]
        weights = torch.sqrt(m * counts.to(torch.float64) / (n * r * p))
        return CenterSelection(centers=x[idx].clone(), indices=idx, weights=weights, counts=counts, probabilities=p)


def nested_leverage_centers(
    scores: Tensor,
    max_centers: int,
    *,
    generator: torch.Generator | None = None,
    max_draws: int | None = None,
) -> NestedLeverageCenters:
    """A stream of draws with probabilities ``p_j = scores_j / sum(scores)`` (inverse CDF, as in
    :func:`leverage_centers`: with a CPU generator the first ``R`` draws are that function's draws
    for ``R`` centers from the same generator state; a CUDA generator's first values depend on how
    many are drawn, so there the two only agree in distribution), long enough for ``max_centers``
    distinct rows or ``max_draws`` draws (default ``16 max_centers``), whichever comes first; see
    :class:`NestedLeverageCenters`.
    ``O(R log n)`` time. Where the mass sits on few rows, fewer than ``max_centers`` distinct rows
    may come out (``.size`` says how many). The draws are over row indices: on data with repeated rows, pass
    :func:`merge_repeated_scores` ``(x, scores)`` to have every center a distinct value (as :func:`auto_fit
    <gpfalkon.auto_fit>` does).
    """
    check_generator(generator)
    if not isinstance(scores, Tensor) or scores.dim() != 1:
        raise TypeError("scores must be a 1-D tensor (one per row)")
    n = int(scores.numel())
    check_scores("scores", scores, n)
    max_centers = check_num_centers(max_centers, n)
    if max_draws is None:
        max_draws = 16 * max_centers
    if isinstance(max_draws, bool) or not isinstance(max_draws, int) or max_draws < max_centers:
        raise ValueError(f"max_draws must be an int >= max_centers={max_centers}, got {max_draws!r}")
    with torch.no_grad():
        s = scores.detach().to(torch.float64)
        cdf = torch.cumsum(s, 0)
        total = float(cdf[-1])
        stream = torch.searchsorted(cdf, _rand(max_draws, generator, s.device) * total, right=True)
        stream.clamp_(max=n - 1)
        pos = torch.arange(max_draws, device=s.device)
        first = torch.full((n,), max_draws, dtype=torch.long, device=s.device)
        first.scatter_reduce_(0, stream, pos, reduce="amin")
        seen = torch.nonzero(first < max_draws).squeeze(-1)
        order = torch.argsort(first[seen])
        indices = seen[order][:max_centers]
        first_draw = first[indices]
        stream = stream[: int(first_draw[-1]) + 1]
    return NestedLeverageCenters(indices=indices, first_draw=first_draw, stream=stream, probabilities=s / total)


def effective_dimension(
    x: Tensor,
    kernel: Kernel,
    penalty: float | Tensor,
    *,
    generator: torch.Generator | None = None,
    scores: Tensor | None = None,
    **kwargs,
) -> float:
    r"""Approximate effective dimension ``d_eff(lambda) = tr K (K + n lambda I)^{-1} = sum_i l_i(lambda)``.

    The number of degrees of freedom of kernel ridge regression at ``lambda``: the
    Nyström approximation is accurate with ``M ~ d_eff log d_eff`` leverage-sampled
    centers (FALKON, Sect. 4.2, Thms. 4-5), so it tells how many centers to use.
    Sum of :func:`approximate_leverage_scores` (cost and guarantee there: each term
    within a constant factor, so the sum too; ``kwargs`` are passed on), or of
    ``scores`` when given (then ``kernel``/``penalty`` are not used and nothing is computed).
    """
    if scores is None:
        scores = approximate_leverage_scores(x, kernel, penalty, generator=generator, **kwargs)
    else:
        check_inputs("x", x)
        check_scores("scores", scores, x.shape[0])
    return float(scores.to(torch.float64).sum())


def _merge_equal_centers(idx: Tensor, counts: Tensor, p: Tensor, centers: Tensor) -> tuple[Tensor, ...]:
    """Drawn rows equal in value merged into the first of them (``centers`` are in index order): ``count_v = sum
    count_j`` and ``p_v`` with ``count_v / p_v = sum count_j / p_j`` (:func:`leverage_centers`); returns the merged
    ``(indices, counts, p, keep)``, ``keep`` the mask of the rows kept. ``O(M d log M)``."""
    keep, to = distinct_groups(centers)
    m = int(keep.sum())
    c = torch.zeros(m, dtype=torch.float64, device=idx.device).index_add_(0, to, counts.to(torch.float64))
    ratio = torch.zeros(m, dtype=torch.float64, device=idx.device).index_add_(0, to, counts.to(torch.float64) / p)
    return idx[keep], c.round().to(counts.dtype), c / ratio, keep


def leverage_centers(
    x: Tensor,
    num_centers: int,
    kernel: Kernel,
    penalty: float | Tensor,
    *,
    generator: torch.Generator | None = None,
    scores: Tensor | None = None,
    weighting: str = "unbiased",
    distinct: bool = True,
    **kwargs,
) -> CenterSelection:
    r"""Nyström centers by approximate ridge-leverage-score sampling (FALKON, appendix A).

    ``R = num_centers`` indices are drawn *with replacement* with probabilities
    ``p_j = l~_j / sum_i l~_i`` (inverse-CDF sampling: ``R`` uniforms and a binary
    search, ``O(n + R log n)``, no limit on ``n``); duplicates are merged into
    ``count_j``, so ``M <= R`` distinct centers are returned, sorted by index, with
    the preconditioner weights

        D_jj = sqrt( M count_j / (n R p_j) ).

    Why this ``D`` (and not the ``1 / sqrt(n p_j count_j)`` of the paper's MATLAB
    code): the preconditioner (:class:`~gpfalkon.FalkonPreconditioner`, docs/math.md §3)
    replaces ``K_Mn K_nM = sum_i K_Mi K_iM`` by ``(n / M) K_MM D^2 K_MM`` with
    ``M`` the number of *distinct* centers (the size of ``K_MM``). The importance-
    sampling estimate of that sum from the ``R`` draws is
    ``sum_j count_j / (R p_j) K_Mj K_jM = K_MM diag(count_j / (R p_j)) K_MM``
    (unbiased), hence ``(n / M) D_jj^2 = count_j / (R p_j)``. The paper's formula
    agrees when every count is 1 (then ``M = R``) but puts ``count_j`` in the
    denominator: a center drawn ``c`` times is under-weighted ``c^2``-fold, which
    hurts exactly at the high-leverage points the sampling targets (measured in
    ``tests/test_centers.py``: median cond(B^T H B) 12 instead of 4.3). Uniform
    probabilities ``p = 1 / n`` with distinct draws give ``D = I``.

    Rows equal in value (data with repeated inputs) are one center (``distinct=True``, the default): the drawn
    rows with one value are merged into its first, with ``count_v = sum count_j`` and ``p_v`` set by
    ``count_v / p_v = sum count_j / p_j``, so that the sketch ``sum_j count_j / (R p_j) K_Mj K_jM`` is the same sum
    (equal rows, equal columns; docs/math.md §3.3a) and ``D`` follows from the formula above with ``M`` the
    number of distinct values. ``distinct=False`` merges equal indices only.

    Args:
        x: ``(n, d)`` training inputs.
        num_centers: ``R``, the number of draws (``1 <= R <= n``).
        kernel, penalty: the kernel and ``lambda`` the scores are computed for
            (the scores, hence the centers, depend on both).
        generator: ``torch.Generator`` for the scores and the draws (deterministic).
        scores: precomputed nonnegative scores ``(n,)`` (e.g. exact ones, or from an
            earlier call); then ``kernel`` and ``penalty`` are not used.
        weighting: ``"unbiased"`` (default, the ``D`` above) or ``"paper"``, the
            literal ``D_jj = 1 / sqrt(n p_j count_j)`` of the paper (docs/math.md §3.3)
            (equal when all counts are 1; measured worse otherwise, see ``tests/test_centers.py``).
        distinct: merge drawn rows equal in value into one center (above).
        kwargs: options of :func:`approximate_leverage_scores`.

    Returns:
        :class:`CenterSelection` with ``centers = x[indices]``, ``indices``,
        ``weights = diag(D)`` (float64), ``counts`` and ``probabilities = p[indices]``.
    """
    rows_info = _Rows(x, kwargs.get("backend"))
    check_inputs("x", x, allow_empty=rows_info.sharded)
    n = rows_info.n  # all shards' rows with a sharded backend (then x and scores are this rank's rows)
    num_centers = check_num_centers(num_centers, n)
    check_generator(generator)
    if weighting not in ("unbiased", "paper"):
        raise ValueError(f"weighting must be 'unbiased' or 'paper', got {weighting!r}")
    _check_distinct(distinct)
    if scores is None:
        scores = approximate_leverage_scores(x, kernel, penalty, generator=generator, **kwargs)
    else:
        check_scores("scores", scores, rows_info.n_local)
    with torch.no_grad():
        s = scores.detach().to(device=x.device, dtype=torch.float64)
        cdf = torch.cumsum(s, 0)
        local_total = float(cdf[-1]) if cdf.numel() else 0.0
        totals = rows_info.concat(torch.tensor([local_total], dtype=torch.float64, device=x.device)).tolist()
        total = sum(totals)
        u = _rand(num_centers, generator, x.device) * total
        if not rows_info.sharded:
            draws = torch.searchsorted(cdf, u, right=True)
            draws.clamp_(max=n - 1)
        else:
            # inverse CDF over the shards: rank r owns [sum(totals[:r]), sum(totals[:r + 1])); the last
            # rank with mass also takes what rounding leaves above the top
            lo = sum(totals[: rows_info.rank])
            last = max(r for r, t in enumerate(totals) if t > 0)
            own = (u >= lo) & ((u < lo + local_total) | torch.tensor(rows_info.rank == last, device=u.device))
            own &= torch.tensor(local_total > 0, device=u.device)
            local = torch.searchsorted(cdf, u[own] - lo, right=True).clamp_(max=max(rows_info.n_local - 1, 0))
            draws = torch.zeros(num_centers, dtype=torch.float64, device=x.device)
            draws[own] = (local + rows_info.offset).to(torch.float64)
            draws = rows_info.backend.reduce_nograd(draws).round().to(torch.long)
        idx, counts = torch.unique(draws, sorted=True, return_counts=True)
        p = rows_info.values_at(s, idx) / total
    centers = rows_info.gather(x, idx)
    if distinct:
        idx, counts, p, keep = _merge_equal_centers(idx, counts, p, centers.detach())
        if not bool(keep.all()):
            centers = centers[keep]
    with torch.no_grad():
        m = idx.numel()
        if weighting == "paper":
            weights = 1.0 / torch.sqrt(n * p * counts.to(torch.float64))
        else:
            weights = torch.sqrt(m * counts.to(torch.float64) / (n * num_centers * p))
    return CenterSelection(centers=centers.clone() if not rows_info.sharded else centers, indices=idx,
                           weights=weights, counts=counts, probabilities=p)


class LeverageCenters:
    """Center selector: ``M`` draws proportional to approximate ridge leverage scores
    (:func:`leverage_centers`), with the preconditioner weights ``D``.

    The scores depend on the kernel and the penalty: the call's ``kernel`` and ``penalty``
    (the model's, when :class:`~gpfalkon.FalkonGP` calls it) are used; a ``penalty`` given
    here wins over the call's. ``kwargs`` are options of :func:`leverage_centers`
    (``weighting``) and :func:`approximate_leverage_scores`.
    """

    def __init__(
        self,
        penalty: float | Tensor | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> None:
        if penalty is not None:
            check_penalty(penalty)
        self.penalty = penalty
        self.generator = _generator(seed, generator)
        self.kwargs = kwargs

    def __call__(
        self, x: Tensor, num_centers: int | None, kernel: Kernel | None = None, penalty: float | Tensor | None = None
    ) -> CenterSelection:
        if num_centers is None:
            num_centers = default_num_centers(x, self.kwargs.get("backend"))
        if kernel is None:
            raise ValueError("leverage-score centers need the kernel (kernel=)")
        lam = self.penalty if self.penalty is not None else penalty
        if lam is None:
            raise ValueError("leverage-score centers need a penalty (LeverageCenters(penalty=...) or penalty=)")
        if isinstance(lam, Tensor):
            lam = lam.detach()
        return leverage_centers(x, num_centers, kernel, lam, generator=self.generator, **self.kwargs)
