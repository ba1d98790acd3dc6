"""Is a fitted ``alpha`` still valid? A small tracker of what the fit depended on.

``alpha`` depends on the kernel's parameters and buffers, the centers, the noise, the
constant mean and the training data. :class:`FitTracker` records, at fit time,

* a snapshot of the small tensors (kernel, centers, noise, mean), compared by value
  (GPyTorch's setters write through ``.data``, which bumps no version counter);
* the identity of the training tensors (storage pointer, in-place version, shape):
  ``O(1)`` to check;
* a **content digest** of the training data (:func:`content_digest` of the bytes of ``x``
  and ``y``, with their shapes and dtypes), recomputed only when the identity changed (a
  copy, a pickle, ``.to()``, an in-place torch operation), and digests of the hyperparameter groups. An edit
  that bypasses the version counter (through ``.data``, or a numpy array sharing the tensor's memory) keeps the
  identity and is not seen: that is the price of an ``O(1)`` check per prediction. Both
  persist in the model's ``state_dict`` (``fit_digest``), so a load that does not match says
  which of ``train_x``, ``train_y``, kernel, centers, noise or mean differs.

The digest is a position-weighted modular sum over the data's machine words,
``h = sum_i w_i m_i mod (2^61 - 1)`` with ``w_i`` the ``i``-th 32-bit word of the bytes and
``m_i = g^i mod p``, ``p = 2^31 - 1``, ``g`` a primitive root of ``p`` (the MINSTD multipliers
16807 and 48271: two independent digests). All products stay below ``2^63`` (exact int64
arithmetic, no overflow), sums are reduced modulo the prime, so the result does not depend on
summation order, thread count or device, and, being additive over positions, the digest of a
sharded data set is the sum of its shards' digests (one collective). Any single changed word
changes it (``w`` and ``m`` are nonzero and below the prime); since the weights are
exponential, not linear, in the position, a structured edit such as a reordering cancels only
when an integer combination of pseudo-random weights vanishes, about ``2^-31`` per digest. The
weights repeat every ``p - 1`` words (8 GiB): a swap of two words exactly a multiple of that
apart is not seen. Cost: ``O(n d)`` integer operations on the data's device, in blocks of
``2^20`` words (a few reads of the data against the ``O(n M d)`` of one FALKON data pass;
``benchmarks/fingerprint.py`` measures it). On the CPU, where the C++ kernels build, the same sum is
taken in one pass (:func:`gpfalkon.backend.fused.word_digest`).

Written here because neither torch nor hashlib hashes a tensor on its device in a way that is
additive over shards: ``hashlib`` needs the bytes on the host.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from .._validation import is_row_source
from ..backend.blocks import scan_rows
from ..backend.fused import word_digest

__all__ = ["FIT_GROUPS", "FitTracker", "content_digest", "data_fingerprint", "hyper_digest", "kernel_identity",
           "module_structure"]

Reduce = Callable[[Tensor], Tensor]

_P61 = 2**61 - 1
_P31 = 2**31 - 1
_ROOTS = (16_807, 48_271)  # primitive roots of 2^31 - 1 (Park and Miller's MINSTD multipliers)
_BLOCK_WORDS = 2**20
_POWERS: dict[tuple[int, str], Tensor] = {}

#: the groups whose digests ``fit_digest`` holds, in order (two int64 entries each), then the
#: dtype code of ``train_x``
FIT_GROUPS = ("train_x", "train_y", "kernel hyperparameters", "centers", "noise", "mean constant")


def dtype_code(dtype: torch.dtype) -> int:
    """A stable integer for ``dtype`` (CRC-32 of its name)."""
    return zlib.crc32(str(dtype).encode())


def _raw_words(t: Tensor) -> tuple[Tensor, int]:
    """The bytes of ``t`` as a flat view of 32-bit words (16- or 8-bit for smaller dtypes), and the word's bits."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    size = flat.element_size()
    if size >= 4:
        return flat.view(torch.int32), 32
    if size == 2:
        return flat.view(torch.int16), 16
    return flat.view(torch.uint8), 8


def _words(t: Tensor) -> Tensor:
    """The bytes of ``t`` as non-negative int64 words (32-bit words; 16- or 8-bit for smaller dtypes)."""
    w, bits = _raw_words(t)
    return w.to(torch.int64) & ((1 << bits) - 1)


def _powers(g: int, device: torch.device) -> Tensor:
    """``g^j mod P31`` for ``j < _BLOCK_WORDS`` (cached per device), by repeated doubling."""
    key = (g, str(device))
    if key not in _POWERS:
        t = torch.ones(1, dtype=torch.int64, device=device)
        while t.numel() < _BLOCK_WORDS:
            step = pow(g, t.numel(), _P31)
            t = torch.cat([t, (t * step) % _P31])  # products < 2^62
        _POWERS[key] = t[:_BLOCK_WORDS]
    return _POWERS[key]


def _hash_words(w: Tensor, offset: int) -> tuple[int, int]:
    """``sum_i w_i g^(offset + i) mod P31`` summed mod P61, for both roots ``g``
    (``w`` at most ``_BLOCK_WORDS`` words)."""
    out = []
    for g in _ROOTS:
        m = (_powers(g, w.device)[: w.numel()] * pow(g, offset, _P31)) % _P31  # in [1, P31): products < 2^62
        v = (w * m) % _P61  # w < 2^32, m < 2^31: the product is < 2^63
        while v.numel() > 1:  # sums of four values < 2^61 stay below 2^63
            pad = (-v.numel()) % 4
            if pad:
                v = torch.cat([v, v.new_zeros(pad)])
            v = v.view(-1, 4).sum(1) % _P61
        out.append(int(v) if v.numel() else 0)
    return out[0], out[1]


def _add(h: tuple[int, int], g: tuple[int, int]) -> tuple[int, int]:
    return (h[0] + g[0]) % _P61, (h[1] + g[1]) % _P61


def _digest_tensor(t: Tensor, word_offset: int) -> tuple[int, int]:
    """Digest of the bytes of tensor ``t`` from ``word_offset``, converted block by block (no int64
    copy of the whole tensor)."""
    if t.device.type == "cpu":
        fast = word_digest(_raw_words(t)[0], word_offset, _ROOTS)  # one pass in C++, where built
        if fast is not None:
            return fast
    h = (0, 0)
    flat = t.detach().contiguous().reshape(-1)
    per = _words_per_element(flat.dtype)
    step = max(1, _BLOCK_WORDS // per)
    for s in range(0, flat.numel(), step):
        h = _add(h, _hash_words(_words(flat[s : s + step]), word_offset + s * per))
    return h


def _digest_rows(t: Tensor, word_offset: int) -> tuple[int, int]:
    """Digest of the bytes of ``t`` (a tensor or a row source read block by block) from ``word_offset``."""
    if not is_row_source(t):
        return _digest_tensor(t, word_offset)
    h, pos = (0, 0), word_offset
    for _, _, blk in t.blocks(scan_rows(t.shape[0], t.shape[1], device=t.device)):
        h = _add(h, _digest_tensor(blk, pos))
        pos += blk.numel() * _words_per_element(blk.dtype)
    return h


def _words_per_element(dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return size // 4 if size >= 4 else 1


def _words_per_row(t: Tensor) -> int:
    cols = 1
    for s in t.shape[1:]:
        cols *= int(s)
    return cols * _words_per_element(t.dtype)


def _meta(t_shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
    """Digest of a shape and dtype (weighted by ``g^j``, ``j`` from ``(p - 1) / 2``, far from the data words)."""
    w = torch.tensor([len(t_shape), *t_shape, dtype_code(dtype)], dtype=torch.int64) & (2**32 - 1)
    return _hash_words(w, (_P31 - 1) // 2)


def content_digest(tensors: Sequence[Tensor]) -> tuple[int, int]:
    """Digest of the bytes, shapes and dtypes of ``tensors`` (in order): two ints below ``2^61``."""
    h, pos = (0, 0), 0
    for t in tensors:
        h = _add(h, _meta(tuple(t.shape), t.dtype))
        h = _add(h, _digest_rows(t, pos))
        pos += t.numel() * _words_per_element(t.dtype)
    return h


def hyper_digest(groups: Sequence[Sequence[Tensor]]) -> list[int]:
    """Two digest entries per group of hyperparameter tensors."""
    out: list[int] = []
    for g in groups:
        out.extend(content_digest(list(g)))
    return out


def _sums(t: Tensor, legacy: bool = False) -> tuple[Tensor, Tensor]:
    """``(sum t, sum t^2)`` in float64, over chunks of ``2^20`` values converted one at a time (torch's
    ``sum(dtype=float64)`` of a large float32 tensor and a float64 copy of the whole of ``t`` both cost
    fresh memory: at 10^8 values 800 MB, 5-10x the time of this loop). ``legacy``: by the whole-tensor
    expressions of states saved before content digests, whose summaries are compared at ``rtol = 1e-12``
    (another summation order can miss that for a sum near zero, e.g. of standardised float64 targets)."""
    if legacy:
        return t.sum(dtype=torch.float64), t.to(torch.float64).square().sum()
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    squares = torch.zeros((), dtype=torch.float64, device=t.device)
    for blk in flat.split(1 << 20):
        b64 = blk.to(torch.float64)
        total += b64.sum()
        squares += torch.dot(b64, b64)
    return total, squares


def _source_summary(x: Any, word_offset: int, legacy_sums: bool) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """``(sum x, sum x^2, digest of x's bytes from word_offset)`` of a row source in one pass over its blocks (the
    digest the blocks' :func:`_digest_tensor` sum to: :func:`_digest_rows`'s)."""
    sx = torch.zeros((), dtype=torch.float64, device=x.device)
    sxx = torch.zeros((), dtype=torch.float64, device=x.device)
    h, pos = (0, 0), word_offset
    for _, _, blk in x.blocks(scan_rows(x.shape[0], x.shape[1], device=x.device)):
        bx, bxx = _sums(blk, legacy_sums)
        sx += bx
        sxx += bxx
        h = _add(h, _digest_tensor(blk, pos))
        pos += blk.numel() * _words_per_element(blk.dtype)
    return sx, sxx, h


def data_fingerprint(
    x: Tensor,
    y: Tensor,
    device: torch.device | None = None,
    reduce: Reduce | None = None,
    row_offset: Callable[[], int] | None = None,
    legacy_sums: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(summary, digest)`` of the training data.

    ``summary = [n, d, sum x, ||x||, sum y, ||y||]`` (float64; for messages, and for state dicts saved
    before digests existed); ``digest = [x_1, x_2, y_1, y_2]`` (int64): :func:`content_digest`-style
    digests of ``x`` and ``y`` with their global shapes and dtypes. ``reduce`` completes row sums over
    the shards of a distributed data set (one collective) and ``row_offset`` gives this shard's first
    global row, so a sharded model's fingerprint is that of all its rows. ``legacy_sums``: the summary's
    sums as states saved before digests computed them (:func:`_sums`), for comparing with such a state.
    """
    x, y = x.detach(), y.detach()
    off = 0 if row_offset is None else int(row_offset())
    if is_row_source(x):  # one streamed pass, once per source (RowSource.memo: its files' stamps are checked)
        sx, sxx, hx = x.memo(("fingerprint", off * _words_per_row(x), legacy_sums),
                             lambda: _source_summary(x, off * _words_per_row(x), legacy_sums))
    else:
        sx, sxx = _sums(x, legacy_sums)
        hx = _digest_rows(x, off * _words_per_row(x))
    hy = _digest_rows(y, off * _words_per_row(y))
    # each digest as a low 31-bit and a high 30-bit half: float64 sums of these over up to 2^22 shards are exact
    halves = [float(v) for h in (*hx, *hy) for v in (h & _P31, h >> 31)]
    sums = torch.tensor([float(x.shape[0]), 0.0, 0.0, 0.0, 0.0, *halves], dtype=torch.float64, device=x.device)
    sums[1], sums[2] = sx, sxx
    sums[3], sums[4] = _sums(y, legacy_sums)
    if reduce is not None:
        sums = reduce(sums)
    n = round(float(sums[0]))
    vals = [round(float(v)) for v in sums[5:]]
    digests = [(vals[2 * i] + (vals[2 * i + 1] << 31)) % _P61 for i in range(4)]
    mx = _meta((n, *x.shape[1:]), x.dtype)
    my = _meta((n, *y.shape[1:]), y.dtype)
    digest = [(digests[0] + mx[0]) % _P61, (digests[1] + mx[1]) % _P61,
              (digests[2] + my[0]) % _P61, (digests[3] + my[1]) % _P61]
    summary = torch.stack([sums[0], torch.tensor(float(x.shape[1]), dtype=torch.float64, device=x.device),
                           sums[1], sums[2].sqrt(), sums[3], sums[4].sqrt()])
    dev = x.device if device is None else device
    return summary.to(dev), torch.tensor(digest, dtype=torch.int64, device=dev)


def _identity(tensors: Sequence[Tensor]) -> tuple:
    """A cheap key of the training data's identity and version: equal keys mean the data did not change since the
    fit (else their content is fingerprinted). A tensor: its storage, version counter and shape. A row source: the
    object, its :meth:`~gpfalkon.backend.sources.RowSource.content_token` (an in-memory tensor's storage and
    version) and its files' stamps (``stat`` calls; a rewritten file gives a key equal to none, so the fingerprint
    runs and names the file)."""
    return tuple(_source_identity(t) if is_row_source(t) else (t.data_ptr(), t._version, tuple(t.shape))
                 for t in tensors)


def _source_identity(t: Any) -> tuple:
    try:
        t.check_unchanged()
    except (ValueError, OSError):
        return (id(t), object())  # equal to no recorded key
    return (id(t), t.content_token(), tuple(t.shape), t.dtype)


def module_structure(module: torch.nn.Module) -> tuple:
    """What a module computes beyond its parameters and buffers: for every submodule (named as in
    ``named_modules``), its class and its public settings of type ``bool`` / ``int`` / ``float`` / ``str``
    (a Matern ``nu``, a polynomial ``power``, ``ard_num_dims``; a constraint's transform is a submodule
    too). Two kernels of other classes with equal raw parameter values (both ``0`` by default) differ
    here. ``O(number of submodules)``; plain Python values (it pickles and deep-copies)."""
    out = []
    for name, mod in module.named_modules():
        kind = type(mod)
        attrs = tuple(sorted((k, v) for k, v in vars(mod).items()
                             if not k.startswith("_") and k != "training" and isinstance(v, bool | int | float | str)))
        out.append((name, f"{kind.__module__}.{kind.__qualname__}", attrs))
    return tuple(out)


class FitTracker:
    """Tracks the validity of a fit. It holds only tensors and plain Python values (it pickles and
    deep-copies with its model); every call receives the current ``hyper`` tensors (compared by value),
    ``data = (x, y)`` and, where given, the ``structure`` of the modules ``hyper`` belongs to
    (:func:`module_structure`: compared by equality)."""

    def __init__(self) -> None:
        self.snapshot: list[Tensor] | None = None
        self.data_key: tuple | None = None
        self.structure: tuple | None = None

    def mark(self, hyper: Sequence[Tensor], data: tuple[Tensor, Tensor], reduce: Reduce | None = None,
             row_offset: Callable[[], int] | None = None, legacy_sums: bool = False,
             structure: tuple | None = None) -> tuple[Tensor, Tensor]:
        """Record the current state as fitted; returns the data's ``(summary, digest)`` to store
        (``reduce``, ``row_offset``, ``legacy_sums``: see :func:`data_fingerprint`)."""
        out = data_fingerprint(*data, reduce=reduce, row_offset=row_offset, legacy_sums=legacy_sums)
        self.snapshot = [t.detach().clone() for t in hyper]  # recorded once the data pass has succeeded
        self.data_key = _identity(data)
        self.structure = structure
        return out

    def forget(self) -> None:
        """Nothing is known to be fitted."""
        self.snapshot = None
        self.data_key = None
        self.structure = None

    def adopt(self, hyper: Sequence[Tensor], data: tuple[Tensor, Tensor] | None = None,
              structure: tuple | None = None) -> None:
        """Take ``hyper`` (and ``data``, when given: already checked by content) as fitted."""
        self.snapshot = [t.detach().clone() for t in hyper]
        self.data_key = None if data is None else _identity(data)
        self.structure = structure

    def data_changed(
        self,
        data: tuple[Tensor, Tensor],
        stored: tuple[Tensor, Tensor | None],
        reduce: Reduce | None = None,
        row_offset: Callable[[], int] | None = None,
    ) -> list[str]:
        """Which of ``train_x`` / ``train_y`` changed since the fit that stored ``stored = (summary,
        digest)``; ``digest=None`` (a state saved before digests existed) compares the summary."""
        if self.data_key is not None and self.data_key == _identity(data):
            return []
        summary, digest = data_fingerprint(*data, device=stored[0].device, reduce=reduce, row_offset=row_offset,
                                           legacy_sums=stored[1] is None)
        if stored[1] is None:
            same = torch.allclose(summary, stored[0].to(torch.float64), rtol=1e-12, atol=0.0)
            changed = [] if same else ["train_x or train_y (sums and norms)"]
        else:
            old = stored[1].to(device=digest.device, dtype=torch.int64)
            changed = [name for i, name in enumerate(("train_x", "train_y"))
                       if not torch.equal(digest[2 * i : 2 * i + 2], old[2 * i : 2 * i + 2])]
        if not changed:
            self.data_key = _identity(data)
        return changed

    def stale(self, hyper: Sequence[Tensor], data: tuple[Tensor, Tensor], stored: tuple[Tensor, Tensor | None],
              reduce: Reduce | None = None, row_offset: Callable[[], int] | None = None,
              structure: tuple | None = None) -> bool:
        """Has anything the fit depends on changed (or was nothing recorded)? A ``structure`` is compared
        where one was recorded (a tracker pickled before structures were recorded has none)."""
        if self.snapshot is None:
            return True
        recorded = getattr(self, "structure", None)
        if recorded is not None and structure is not None and structure != recorded:
            return True
        if len(hyper) != len(self.snapshot) or any(
            a.shape != b.shape or not torch.equal(a.detach(), b.to(device=a.device, dtype=a.dtype))
            for a, b in zip(hyper, self.snapshot, strict=False)
        ):
            return True
        return bool(self.data_changed(data, stored, reduce=reduce, row_offset=row_offset))


def kernel_identity(kernel: Kernel, device: torch.device) -> dict[str, Tensor]:
    """What makes two ranks' kernels the same, for ``check_consistent``: its parameters and buffers (float64, one
    vector) and its classes and settings (:func:`~gpfalkon.models.fit_state.module_structure`) as one number, the
    CRC-32 of their text (a Matern ``nu`` or a kernel class is neither a parameter nor a buffer)."""
    values = [t.detach().reshape(-1).to(torch.float64) for t in (*kernel.parameters(), *kernel.buffers())]
    structure = float(zlib.crc32(repr(module_structure(kernel)).encode()))
    return {"kernel_hyperparameters": torch.cat(values) if values else torch.zeros(0, dtype=torch.float64,
                                                                                  device=device),
            "kernel_structure": torch.tensor([structure], dtype=torch.float64, device=device)}
