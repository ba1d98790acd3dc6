"""Row sources: training inputs read block by block, so ``x`` need not fit in memory.

A :class:`RowSource` is an ``(n, d)`` matrix that lives elsewhere (``.npy`` files on disk,
Parquet files) and is read in row blocks. gpfalkon's passes only ever touch ``x`` through
row slices ``x[start:stop]`` and row gathers ``x[indices]``, so a row source offers exactly
that much of the tensor interface (``shape``, ``dtype``, ``device``, slicing, gathering) and
can be passed wherever training inputs go (``FalkonGP(source, y, ...)``): the kernel engine
then streams blocks from it and keeps ``K_nM`` only if it fits the memory budget.

* :class:`NpyRows` - one or more C-ordered 2-D ``.npy`` files, concatenated by rows, read with
  positioned file reads (no memory map: resident memory stays at one block, not the file).
* :class:`ParquetRows` - Parquet files (pyarrow), the chosen float columns as features, read a
  row group at a time (the last one kept).
* :class:`TensorRows` - an in-memory tensor as a row source (for tests and uniform code).
* :func:`shard_rows` - this rank's contiguous part of a source (:class:`SliceRows`), for a
  distributed run; :func:`shard_files` - a list of files split between ranks.

A source's rows are fixed: a model fitted on one reads it again (variance factors, objectives), so each file's
size and modification time are recorded when the source is opened, and a read of a file rewritten since raises
``ValueError`` naming it (copies and pickles keep the record). :meth:`RowSource.astype` / :func:`rows_as` read the
same rows in another dtype, block by block (the float64 kernel values of a float32 model's variance factors).

Costs: every pass over the data reads ``n d`` values; a block read costs one ``pread`` per file
(``.npy``) or the decompression of the row groups it touches (Parquet, whose row groups should
hold at least a few thousand rows).

Written here because neither torch nor pyarrow offers random row-block access to a stack of
files as a float matrix (``torch.utils.data`` iterates samples; ``pyarrow.dataset`` scans).
"""
from __future__ import annotations

import abc
import copy
import itertools
import os
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor

from .blocks import row_blocks, scan_rows

__all__ = ["MAX_OPEN_FILES", "NpyRows", "ParquetRows", "RowSource", "SliceRows", "TensorRows", "rows_as", "shard_files",
           "shard_rows"]

PathLike = Union[str, "os.PathLike[str]"]

_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}

#: the most Parquet files a :class:`ParquetRows` keeps open at once (the least recently read is closed)
MAX_OPEN_FILES = 8


def _concrete(device: torch.device | str | None) -> torch.device:
    """``device`` with the current CUDA device's index filled in (``"cuda"`` -> ``cuda:0``): the
    device the rows' tensors will report, so that device checks against them compare equal."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class RowSource(abc.ABC):
    """An ``(n, d)`` float matrix read in row blocks (see the module docstring).

    Subclasses implement :meth:`read`; the rest - slicing, gathering, block iteration, the
    finiteness check - is built on it. Rows come back as CPU tensors in ``dtype`` unless
    ``device`` says otherwise (blocks are then moved there after reading).
    """

    def __init__(self, n: int, d: int, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"a row source holds float32 or float64 rows, got {dtype}")
        self._n, self._d = int(n), int(d)
        self.dtype = dtype
        self.device = _concrete(device)
        self._version = 0  # for gpfalkon's fit tracking: a source is immutable

    # --------------------------------------------------------------- the matrix
    @abc.abstractmethod
    def _read(self, start: int, stop: int) -> np.ndarray | Tensor:
        """Rows ``start .. stop - 1`` (``0 <= start <= stop <= n``) as a 2-D array."""

    def read(self, start: int, stop: int) -> Tensor:
        """Rows ``start .. stop - 1`` as an ``(stop - start, d)`` tensor in ``dtype`` on ``device``."""
        return self._rows(start, stop, self.device)

    def read_host(self, start: int, stop: int) -> Tensor:
        """Rows ``start .. stop - 1`` as a CPU tensor in ``dtype`` (what
        :func:`gpfalkon.backend.prefetch.source_blocks` copies to the device through pinned memory)."""
        return self._rows(start, stop, torch.device("cpu"))

    def _rows(self, start: int, stop: int, device: torch.device) -> Tensor:
        start, stop = max(0, int(start)), min(self._n, int(stop))
        if stop <= start:
            return torch.empty(0, self._d, dtype=self.dtype, device=device)
        a = self._read(start, stop)
        t = a if isinstance(a, Tensor) else torch.from_numpy(np.ascontiguousarray(a))
        return t.to(dtype=self.dtype, device=device)

    @property
    def host_resident(self) -> bool:
        """Whether the rows live in host memory or files (not on a GPU already): a pass over them on
        a CUDA device copies every block (the prefetcher overlaps those copies with compute)."""
        return True

    def take(self, indices: Tensor) -> Tensor:
        """Rows ``indices`` (any order, repeats allowed): one read per run of consecutive rows
        after sorting."""
        idx = torch.as_tensor(indices).reshape(-1).to("cpu", torch.int64)
        if idx.numel() == 0:
            return torch.empty(0, self._d, dtype=self.dtype, device=self.device)
        if bool((idx < 0).any()) or bool((idx >= self._n).any()):
            raise IndexError(f"row indices out of range for a source of {self._n} rows")
        order = torch.argsort(idx)
        srt = idx[order]
        out = torch.empty(idx.numel(), self._d, dtype=self.dtype, device=self.device)
        breaks = torch.nonzero(srt[1:] - srt[:-1] > 1).reshape(-1) + 1
        bounds = [0, *breaks.tolist(), srt.numel()]
        for a, b in itertools.pairwise(bounds):
            lo, hi = int(srt[a]), int(srt[b - 1]) + 1
            blk = self.read(lo, hi)
            out[order[a:b].to(self.device)] = blk[(srt[a:b] - lo).to(self.device)]
        return out

    def blocks(self, rows: int) -> Iterator[tuple[int, int, Tensor]]:
        """``(start, stop, x[start:stop])`` over the whole source in blocks of ``rows``."""
        for s, e in row_blocks(self._n, max(1, int(rows))):
            yield s, e, self.read(s, e)

    def check_finite(self, name: str, rows: int | None = None) -> None:
        """Raise ``ValueError`` naming ``name`` and the first row with a NaN or Inf (one pass, in blocks of ``rows``;
        default: :func:`~gpfalkon.backend.blocks.scan_rows`, within the memory budget). A pass that found every row
        finite is remembered (:meth:`memo`): the next checks of the unchanged rows cost ``stat`` calls."""

        def scan() -> bool:
            step = scan_rows(self._n, self._d, device=self.device) if rows is None else rows
            for s, _, blk in self.blocks(step):
                bad = ~torch.isfinite(blk).all(-1)
                if bool(bad.any()):
                    row = s + int(bad.nonzero()[0])
                    raise ValueError(f"{name} contains NaN or Inf values (first at row {self._row_label(row)})")
            return True

        self.memo("finite", scan)

    def _row_label(self, row: int) -> str:
        """Row ``row`` of this source as an error message names it."""
        return str(row)

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()``'s value, computed once per ``key`` (and this source's dtype and device) while the rows stay
        the same: a summary of the whole source (its finiteness, the fit tracker's fingerprint) is one pass, not one
        per fit. Files are checked first (:meth:`check_unchanged`: a rewritten file raises, as its reads would); an
        in-memory tensor's identity and version counter (:meth:`content_token`) key the values, so an edit in place
        computes them again. A ``compute`` that raises stores nothing. Copies and pickles start without the values."""
        self.check_unchanged()
        token = self.content_token()
        held: tuple[Hashable, dict[Hashable, Any]] | None = self.__dict__.get("_memo")
        if held is None or held[0] != token:
            held = (token, {})
            self.__dict__["_memo"] = held
        values = held[1]
        full = (key, self.dtype, self.device)
        if full not in values:
            values[full] = compute()
        return values[full]

    def content_token(self) -> Hashable:
        """What changes where the rows may have changed without a file's stamp changing: ``None`` for files (their
        stamps are checked instead, :meth:`check_unchanged`); an in-memory tensor's storage and version counter
        (:class:`TensorRows`). With :meth:`check_unchanged` it is how a fitted model sees its source's rows change."""
        return None

    def __getstate__(self) -> dict:
        # the memo stays with this object: a pickled in-memory tensor comes back with another version counter, and
        # possibly at the address of the freed one, so its token could match rows it was not computed on
        state = dict(self.__dict__)
        state.pop("_memo", None)
        return state

    def check_unchanged(self) -> None:
        """Raise ``ValueError`` where a file under this source was rewritten or replaced since it was opened (its
        size, modification time or inode: ``O(files)`` ``stat`` calls, no rows read). In-memory sources have nothing
        to check. Every read checks the files it touches; this checks them all at once, e.g. before the collectives of
        a sharded fit, so a rank whose files changed is found before the others wait on it."""
        return None  # in-memory rows (TensorRows): nothing on disk to change

    # ------------------------------------------------- the tensor surface gpfalkon uses
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self._n, self._d))

    def dim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self._n

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __getitem__(self, key: Any) -> Tensor:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._n)
            if step != 1:
                raise IndexError("a row source supports contiguous row slices only (step 1)")
            return self.read(start, stop)
        if isinstance(key, Tensor) and key.dtype in (torch.int64, torch.int32) and key.dim() == 1:
            return self.take(key)
        if isinstance(key, Tensor) and key.dtype == torch.bool and key.shape == (self._n,):
            return self.take(key.nonzero().reshape(-1))
        raise IndexError(f"a row source supports row slices and 1-D index tensors, got {type(key).__name__}")

    def detach(self) -> RowSource:
        return self

    @property
    def requires_grad(self) -> bool:
        return False

    def data_ptr(self) -> int:
        return id(self)

    def is_floating_point(self) -> bool:
        return True

    def astype(self, dtype: torch.dtype) -> RowSource:
        """This source read in ``dtype`` (float32 or float64): :meth:`to` with that dtype."""
        return self.to(dtype=dtype)

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> RowSource:
        """This source read in ``dtype`` (float32 or float64) onto ``device`` (``None``: as now): a shallow copy
        sharing the files or tensor, each block converted and moved as it is read (no copy of the rows), or this
        source itself where nothing changes."""
        dtype = self.dtype if dtype is None else dtype
        device = self.device if device is None else _concrete(device)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"a row source holds float32 or float64 rows, got {dtype}")
        if dtype == self.dtype and device == self.device:
            return self
        out = copy.copy(self)
        out.dtype, out.device = dtype, device
        return out

    def materialize(self) -> Tensor:
        """All rows in memory (``n d`` values): for small sources and tests."""
        return self.read(0, self._n)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self._n:,}, d={self._d}, dtype={self.dtype})"


def rows_as(x: Tensor | RowSource, dtype: torch.dtype) -> Tensor | RowSource:
    """``x`` (a tensor or a row source) with its rows in ``dtype``: ``x`` itself where it already is, else a row
    source converting block by block (:meth:`RowSource.astype`; for a tensor a :class:`TensorRows` over it), so a
    pass in a wider dtype costs one block of it, not a converted copy of all ``n d`` values."""
    if x.dtype == dtype:
        return x
    source = x if isinstance(x, RowSource) else TensorRows(x)
    return source.astype(dtype)


class TensorRows(RowSource):
    """An in-memory ``(n, d)`` tensor as a row source.

    Args:
        x: the rows.
        device: where read blocks go (default ``x.device``). A CPU tensor with a CUDA ``device``
            is the way to fit on a GPU data that do not fit its memory: every pass copies the
            rows block by block, through pinned buffers, overlapped with the GPU's work
            (:mod:`gpfalkon.backend.prefetch`); only the blocks in flight are on the GPU.
    """

    def __init__(self, x: Tensor, device: torch.device | str | None = None) -> None:
        if not isinstance(x, Tensor) or x.dim() != 2:
            raise ValueError(f"x must be a 2-D tensor, got {type(x).__name__}")
        super().__init__(x.shape[0], x.shape[1], x.dtype, x.device if device is None else torch.device(device))
        self.x = x.detach()

    def _read(self, start: int, stop: int) -> Tensor:
        return self.x[start:stop]

    def content_token(self) -> Hashable:
        return self.x.data_ptr(), self.x._version, tuple(self.x.shape), tuple(self.x.stride())

    @property
    def host_resident(self) -> bool:
        return self.x.device.type == "cpu"


class SliceRows(RowSource):
    """Rows ``start .. stop - 1`` of another source (a rank's shard)."""

    def __init__(self, source: RowSource, start: int, stop: int) -> None:
        if not (0 <= start <= stop <= len(source)):
            raise ValueError(f"need 0 <= start <= stop <= {len(source)}, got {start}, {stop}")
        super().__init__(stop - start, source.shape[1], source.dtype, source.device)
        self.source, self.start = source, int(start)

    def _read(self, start: int, stop: int) -> np.ndarray | Tensor:
        return self.source._read(self.start + start, self.start + stop)

    @property
    def host_resident(self) -> bool:
        return self.source.host_resident

    def check_unchanged(self) -> None:
        self.source.check_unchanged()

    def _row_label(self, row: int) -> str:
        return f"{row}, row {self.source._row_label(self.start + row)} of the source it slices"

    def content_token(self) -> Hashable:
        return self.source.content_token()


def _as_paths(paths: PathLike | Sequence[PathLike], what: str, empty_ok: bool = False) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = [os.fspath(p) for p in paths]
    if not out and not empty_ok:
        raise ValueError(f"{what}: no files given")
    for p in out:
        if os.path.isdir(p):
            # the pattern names the format's extension: a writer's markers (Spark's _SUCCESS, .crc files) are no data
            ext = {"NpyRows": ".npy", "ParquetRows": ".parquet"}.get(what, "")
            raise IsADirectoryError(f"{what}: {p} is a directory; pass its files (e.g. sorted(glob('{p}/*{ext}')))")
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{what}: {p} does not exist")
    return out


def _empty_shape(what: str, d: int | None, dtype: torch.dtype | None, hint: str) -> tuple[int, torch.dtype]:
    """``(d, dtype)`` of a source with no files (a surplus rank's :func:`shard_files`), which must be given."""
    if d is None or dtype is None or isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"{what}: no files given; an empty source (a rank that shard_files left without files) "
                         f"needs {hint} (the other ranks' features), got d={d!r}, dtype={dtype!r}")
    return d, dtype


def _stamp(path: PathLike) -> tuple[int, ...]:
    """``(size, modification time in ns, inode)`` of ``path``: what :func:`_check_stamp` compares. The inode catches
    a file replaced by another one renamed over it with the same size and modification time (``cp -p``, ``rsync -a``
    and ``tar x`` keep both); the change time is left out (``chmod`` and hard links change it, not the rows). Not
    seen: a file rewritten in place, or deleted and written anew on a reused inode, with exactly its old size and
    modification time (``cp -p`` of a file whose time equals the old one's to the nanosecond)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def _check_stamp(kind: str, path: PathLike, stamp: tuple[int, ...] | None) -> None:
    """Raise ``ValueError`` where ``path`` was rewritten since the source recorded ``stamp`` (``None``: not
    recorded). A model fitted on a source keeps reading it (variance factors, predictions' passes): rows that
    changed underneath would silently mix two data sets, and no in-memory version counter sees a file. Copies and
    pickles keep the stamps: a source unpickled where its files were written anew (copied to another machine without
    their modification times) is refused too; build it again there."""
    # a stamp pickled by an earlier version holds (size, mtime) only: compared on those
    if stamp is not None and _stamp(path)[:len(stamp)] != tuple(stamp):
        raise ValueError(f"{kind}: {path} changed since the source was opened (size, modification time or inode: "
                         "another file put in its place); a "
                         "source's rows are fixed: build a new source, and refit, for new data")


class NpyRows(RowSource):
    """C-ordered 2-D ``.npy`` files (float32 / float64), concatenated by rows.

    Args:
        paths: one path or a list (all with the same number of columns and dtype); an empty list
            (a surplus rank's :func:`shard_files`) gives a source of 0 rows, which needs ``d`` and ``dtype``.
        dtype: the rows' dtype after reading (default: the files').
        device: where read blocks go (default CPU).
        d: the number of features, only for an empty ``paths``.

    Reads are positioned file reads of the requested rows (``np.fromfile`` at an offset): no
    memory map, so the resident memory of a pass is one block whatever the file size. Each file's
    size is checked against its header (a truncated file is named at construction).
    """

    def check_unchanged(self) -> None:
        for path, stamp in getattr(self, "_stamps", {}).items():
            _check_stamp("NpyRows", path, stamp)

    def __init__(self, paths: PathLike | Sequence[PathLike], dtype: torch.dtype | None = None,
                 device: torch.device | None = None, d: int | None = None) -> None:
        self.paths = _as_paths(paths, "NpyRows", empty_ok=True)
        self._files: list[tuple[str, int, int, np.dtype]] = []  # path, rows, data offset, dtype
        self._stamps: dict[str, tuple[int, ...]] = {}  # path -> _stamp: rewritten or replaced files are refused
        if not self.paths:
            d0, dt0 = _empty_shape("NpyRows", d, dtype, "d= and dtype=")
            self._starts = np.zeros(1, dtype=np.int64)
            super().__init__(0, d0, dt0, device)
            return
        d = None
        fdt: np.dtype | None = None
        for p in self.paths:
            with open(p, "rb") as f:
                try:
                    version = np.lib.format.read_magic(f)
                    header = (
                        np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, fortran, dt = header(f)
                except ValueError as exc:
                    raise ValueError(f"NpyRows: {p} is not a .npy file ({exc})") from exc
                offset = f.tell()
            if len(shape) != 2:
                raise ValueError(f"NpyRows: {p} holds an array of shape {shape}; need (rows, features)")
            if fortran:
                raise ValueError(f"NpyRows: {p} is Fortran-ordered; save it C-ordered (np.ascontiguousarray)")
            native = dt.newbyteorder("=")  # a file of the other byte order is read as stored, then converted
            if native not in _DTYPES:
                raise TypeError(f"NpyRows: {p} has dtype {dt}; need float32 or float64")
            if d is not None and (shape[1] != d or native != fdt):
                raise ValueError(f"NpyRows: {p} has {shape[1]} columns of {native}, the first file {d} of {fdt}")
            need = offset + int(shape[0]) * int(shape[1]) * dt.itemsize
            size = os.path.getsize(p)
            if size < need:
                raise ValueError(f"NpyRows: {p} is truncated: its header says {shape[0]} x {shape[1]} {dt} ({need} "
                                 f"bytes with the header), the file has {size} bytes")
            d, fdt = shape[1], native
            self._files.append((p, int(shape[0]), offset, dt))
            self._stamps[p] = _stamp(p)
        assert d is not None and fdt is not None
        self._starts = np.cumsum([0] + [r for _, r, _, _ in self._files])
        super().__init__(int(self._starts[-1]), d, _DTYPES[fdt] if dtype is None else dtype, device)

    def _read(self, start: int, stop: int) -> np.ndarray:
        parts = []
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        for i in range(first, len(self._files)):
            f0 = int(self._starts[i])
            if f0 >= stop:
                break
            path, rows, offset, dt = self._files[i]
            lo, hi = max(start, f0) - f0, min(stop, f0 + rows) - f0
            if hi <= lo:
                continue
            row_bytes = self._d * dt.itemsize
            _check_stamp("NpyRows", path, getattr(self, "_stamps", {}).get(path))
            with open(path, "rb") as fh:
                a = np.fromfile(fh, dtype=dt, count=(hi - lo) * self._d, offset=offset + lo * row_bytes)
            if a.size != (hi - lo) * self._d:  # the file shrank after it was opened
                raise ValueError(f"NpyRows: {path} ended early: rows {lo}..{hi - 1} need {(hi - lo) * row_bytes} bytes "
                                 f"at offset {offset + lo * row_bytes}, {a.size * dt.itemsize} were read")
            if not dt.isnative:
                a = a.astype(dt.newbyteorder("="))
            parts.append(a.reshape(hi - lo, self._d))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _open_parquet(pq: Any, path: PathLike) -> Any:
    """``pyarrow.parquet.ParquetFile(path)``, its errors (an empty or truncated file, not Parquet at all) re-raised
    naming the file: pyarrow's own messages ("Parquet file size is 0 bytes", "magic bytes not found") do not."""
    import pyarrow as pa

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"ParquetRows: {path} is not a readable Parquet file ({exc})") from exc


class ParquetRows(RowSource):
    """Parquet files (pyarrow), the given numeric ``columns`` as features, concatenated by rows.

    Args:
        paths: one path or a list (same schema); an empty list (a surplus rank's :func:`shard_files`)
            gives a source of 0 rows, which needs ``columns``.
        columns: feature column names (default: every column except ``exclude``), numeric
            (integer, floating point or decimal) in every file.
        exclude: a list of column names left out by default (e.g. the target); each must be a column.
        dtype: the rows' dtype (default float64).

    Rows are read a row group at a time (the last group read is cached), so the resident
    memory of a pass is about one row group of the chosen columns.
    """

    def check_unchanged(self) -> None:
        for path, stamp in getattr(self, "_stamps", {}).items():
            _check_stamp("ParquetRows", path, stamp)

    def __init__(self, paths: PathLike | Sequence[PathLike], columns: Sequence[str] | None = None,
                 exclude: Sequence[str] = (), dtype: torch.dtype = torch.float64,
                 device: torch.device | None = None) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - pyarrow is a declared extra
            raise ImportError("ParquetRows needs pyarrow: pip install 'gpfalkon[data]'") from exc
        import pyarrow.types as pat

        self.paths = _as_paths(paths, "ParquetRows", empty_ok=True)
        self._pq = pq
        if isinstance(exclude, str) or not all(isinstance(c, str) for c in exclude):
            raise TypeError(f"ParquetRows: exclude must be a list of column names, got {exclude!r}")
        if isinstance(columns, str):
            raise TypeError(f"ParquetRows: columns must be a list of column names, got {columns!r}")
        self._groups: list[tuple[int, int, int]] = []  # (file index, row group, rows)
        self._cache: tuple[int, np.ndarray | None] = (-1, None)
        self._handles: dict = {}
        self._lock = threading.Lock()  # the handles and the cache, shared by copies of the source too
        self._stamps: dict = {}  # path -> _stamp: rewritten or replaced files are refused
        if not self.paths:
            d0, _ = _empty_shape("ParquetRows", None if columns is None else len(list(columns)), dtype, "columns=")
            self.columns = list(columns or [])
            self._starts = np.zeros(1, dtype=np.int64)
            super().__init__(0, d0, dtype, device)
            return
        names = list(_open_parquet(pq, self.paths[0]).schema_arrow.names)
        unknown = [c for c in exclude if c not in names]
        if unknown:
            raise ValueError(f"ParquetRows: exclude names {unknown}, not columns of {self.paths[0]} (has {names})")
        if columns is None:
            columns = [c for c in names if c not in set(exclude)]
        columns = list(columns)
        missing = [c for c in columns if c not in names]
        if missing or not columns:
            raise ValueError(f"ParquetRows: columns {missing or columns} not in {self.paths[0]} (has {names})")
        self.columns = columns
        for i, p in enumerate(self.paths):
            pf = _open_parquet(pq, p)
            schema = pf.schema_arrow
            lacking = [c for c in columns if c not in schema.names]
            if lacking:
                raise ValueError(f"ParquetRows: {p} lacks the columns {lacking} (has {list(schema.names)})")
            for c in columns:
                typ = schema.field(c).type
                if not (pat.is_integer(typ) or pat.is_floating(typ) or pat.is_decimal(typ)):
                    raise TypeError(f"ParquetRows: column {c!r} of {p} has type {typ}; features must be numeric "
                                    "(integer, floating point or decimal): leave it out with exclude= or columns=")
            self._stamps[p] = _stamp(p)
            meta = pf.metadata
            for g in range(meta.num_row_groups):
                self._groups.append((i, g, meta.row_group(g).num_rows))
        self._starts = np.cumsum([0] + [r for _, _, r in self._groups])
        super().__init__(int(self._starts[-1]), len(columns), dtype, device)

    def _group(self, k: int) -> np.ndarray:
        if self._cache[0] != k:
            fi, g, _ = self._groups[k]
            _check_stamp("ParquetRows", self.paths[fi], getattr(self, "_stamps", {}).get(self.paths[fi]))
            pf = self._handles.pop(fi, None)
            if pf is None:
                pf = self._pq.ParquetFile(self.paths[fi])
            self._handles[fi] = pf  # the most recently used last
            while len(self._handles) > MAX_OPEN_FILES:  # a data set of thousands of files stays within the fd limit
                old = self._handles.pop(next(iter(self._handles)))
                close = getattr(old, "close", None)
                if callable(close):
                    close()
            table = pf.read_row_group(g, columns=self.columns)
            for c in self.columns:  # nulls would become NaN (or fail for integers) and be reported as such
                nulls = table.column(c).null_count
                if nulls:
                    raise ValueError(f"ParquetRows: column {c!r} of {self.paths[fi]} has {nulls} null values (row "
                                     f"group {g}); fill or drop them before fitting")
            cols = [table.column(c).to_numpy(zero_copy_only=False) for c in self.columns]
            a = np.stack(cols, 1).astype(np.float64 if self.dtype == torch.float64 else np.float32, copy=False)
            self._cache = (k, a)
            return a
        return self._cache[1]  # type: ignore[return-value]

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start .. stop - 1``, a new array (never a view of the cached row group: a caller that edits its
        block in place must not change what later reads return). One thread at a time: the open files and the one
        group's cache are shared (pyarrow's reader raised from two threads)."""
        with self._lock:
            out = self._read_locked(start, stop)
        return out.copy() if out.base is not None else out

    def _read_locked(self, start: int, stop: int) -> np.ndarray:
        parts = []
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        while k < len(self._groups) and int(self._starts[k]) < stop:
            g0 = int(self._starts[k])
            a = self._group(k)
            lo, hi = max(start, g0) - g0, min(stop, g0 + a.shape[0]) - g0
            if hi > lo:
                parts.append(a[lo:hi])
            k += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_handles"], state["_cache"], state["_pq"], state["_lock"] = {}, (-1, None), None, None
        return state

    def __setstate__(self, state: dict) -> None:
        import pyarrow.parquet as pq

        self.__dict__.update(state)
        self._pq = pq
        self._lock = threading.Lock()


def shard_rows(source: RowSource, rank: int | None = None, world_size: int | None = None) -> SliceRows:
    """This rank's contiguous part of ``source`` (balanced; defaults: torch.distributed's rank and
    world size): the shards in rank order are the source's rows in order."""
    from .distributed import shard_range

    start, stop = shard_range(len(source), rank, world_size)
    return SliceRows(source, start, stop)


def shard_files(paths: Sequence[PathLike], rank: int | None = None, world_size: int | None = None) -> list[str]:
    """Files ``rank, rank + world_size, ...`` of ``paths`` (round robin; an empty list where there
    are fewer files than ranks). Defaults: torch.distributed's rank and world size. For whole-file
    shards; :func:`shard_rows` balances rows instead.

    The global row order of a sharded model is the ranks' order, so with round robin it is files ``0, w, 2w, ...,
    1, w + 1, ...``: not ``paths``' order, and it changes with the number of ranks ``w`` (and with it the centers
    a seed draws from the rows). Where the model must not depend on ``w``, use :func:`shard_rows` on one source."""
    from .distributed import shard_range

    files = [os.fspath(p) for p in paths]
    shard_range(0, rank, world_size)  # validates rank / world size (and reads the defaults)
    if rank is None or world_size is None:
        import torch.distributed as dist

        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    return files[rank::world_size]
