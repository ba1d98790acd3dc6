"""Row sources (data read block by block from .npy / Parquet files) against the in-memory tensors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import gpfalkon
from gpfalkon import FalkonGP
from gpfalkon.backend.sources import NpyRows, ParquetRows, SliceRows, TensorRows, shard_files, shard_rows
from gpfalkon.errors import NotFittedError
from gpfalkon.objectives import GCV, SGPRBound, StochasticNystromCompReg

from conftest import make_data, make_kernel


def _write_npy(tmp_path, x: np.ndarray, parts: int = 2):
    bounds = np.linspace(0, len(x), parts + 1).astype(int)
    paths = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        p = tmp_path / f"x{i}.npy"
        np.save(p, x[a:b])
        paths.append(p)
    return paths


def _write_parquet(tmp_path, x: np.ndarray, y: np.ndarray, row_group_size: int = 37):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    cols = {f"f{j}": x[:, j] for j in range(x.shape[1])}
    cols["target"] = y
    half = len(x) // 2
    paths = []
    for i, sl in enumerate((slice(0, half), slice(half, None))):
        p = tmp_path / f"part{i}.parquet"
        pq.write_table(pa.table({k: v[sl] for k, v in cols.items()}), p, row_group_size=row_group_size)
        paths.append(p)
    return paths


@pytest.fixture
def data():
    x, y = make_data(n=301, d=3, seed=4, dtype=torch.float64)
    return x, y


def test_npy_rows_read_slices_and_gathers_across_files(tmp_path, data):
    x, _ = data
    src = NpyRows(_write_npy(tmp_path, x.numpy(), parts=3))
    assert src.shape == x.shape and src.dtype == torch.float64 and len(src) == x.shape[0]
    torch.testing.assert_close(src[0:301], x, rtol=0, atol=0)
    torch.testing.assert_close(src[95:205], x[95:205], rtol=0, atol=0)  # spans all three files
    idx = torch.tensor([300, 0, 150, 151, 0, 99, 100])
    torch.testing.assert_close(src[idx], x[idx], rtol=0, atol=0)
    assert src[5:5].shape == (0, 3)
    f32 = NpyRows(_write_npy(tmp_path, x.numpy()), dtype=torch.float32)
    torch.testing.assert_close(f32[0:10], x[:10].float(), rtol=0, atol=0)


def test_npy_rows_errors_name_the_file(tmp_path, data):
    x, _ = data
    with pytest.raises(FileNotFoundError, match="does not exist"):
        NpyRows(tmp_path / "missing.npy")
    np.save(tmp_path / "f.npy", np.asfortranarray(x.numpy()))
    with pytest.raises(ValueError, match="Fortran-ordered"):
        NpyRows(tmp_path / "f.npy")
    np.save(tmp_path / "i.npy", np.zeros((4, 3), dtype=np.int64))
    with pytest.raises(TypeError, match="need float32 or float64"):
        NpyRows(tmp_path / "i.npy")
    np.save(tmp_path / "a.npy", np.zeros((4, 3)))
    np.save(tmp_path / "b.npy", np.zeros((4, 2)))
    with pytest.raises(ValueError, match="2 columns"):
        NpyRows([tmp_path / "a.npy", tmp_path / "b.npy"])
    with pytest.raises(IndexError, match="contiguous row slices"):
        NpyRows(tmp_path / "a.npy")[0:4:2]


def test_parquet_rows_read_row_groups_and_columns(tmp_path, data):
    x, y = data
    src = ParquetRows(_write_parquet(tmp_path, x.numpy(), y.numpy()), exclude=["target"])
    assert src.columns == ["f0", "f1", "f2"] and src.shape == x.shape
    torch.testing.assert_close(src[0:301], x, rtol=0, atol=0)
    torch.testing.assert_close(src[30:190], x[30:190], rtol=0, atol=0)  # many row groups, both files
    idx = torch.tensor([299, 3, 150, 3])
    torch.testing.assert_close(src[idx], x[idx], rtol=0, atol=0)
    two = ParquetRows(_write_parquet(tmp_path, x.numpy(), y.numpy()), columns=["f2", "f0"])
    torch.testing.assert_close(two[0:301], x[:, [2, 0]], rtol=0, atol=0)
    with pytest.raises(ValueError, match="not in"):
        ParquetRows(_write_parquet(tmp_path, x.numpy(), y.numpy()), columns=["nope"])
    # an empty file and a file that is not Parquet are named (pyarrow's messages do not name them)
    good = _write_parquet(tmp_path, x.numpy(), y.numpy())
    for name, content in (("empty.parquet", b""), ("text.parquet", b"f0,f1,f2\n1,2,3\n")):
        bad = tmp_path / name
        bad.write_bytes(content)
        for paths in ([bad], [*good, bad]):
            with pytest.raises(ValueError, match=rf"ParquetRows: .*{name} is not a readable Parquet file"):
                ParquetRows(paths)
    with pytest.raises(FileNotFoundError):
        ParquetRows([tmp_path / "missing.parquet"])
    # nulls are named as nulls (not as NaN), float and integer columns alike
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    holes = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"a": pa.array([1.0, None, 3.0]), "b": pa.array([1, 2, None])}), holes)
    for cols, name in ((["a"], "a"), (["b"], "b")):
        with pytest.raises(ValueError, match=rf"column '{name}' of .*holes.parquet has 1 null values"):
            ParquetRows([holes], columns=cols)[0:3]


def test_a_source_with_nan_is_rejected_with_its_row(tmp_path, data):
    x, y = data
    bad = x.numpy().copy()
    bad[123, 1] = np.nan
    src = NpyRows(_write_npy(tmp_path, bad))
    with pytest.raises(ValueError, match=r"train_x contains NaN or Inf values \(first at row 123\)"):
        FalkonGP(src, y, num_centers=10)
    # a rank's shard names the row in the shard and in the whole source
    with pytest.raises(ValueError, match=r"first at row 23, row 123 of the source it slices\)"):
        SliceRows(src, 100, 200).check_finite("train_x")


@pytest.mark.parametrize("store", [True, False])
def test_falkon_gp_on_a_file_source_equals_in_memory(tmp_path, data, store):
    x, y = data
    test_x = x[:20] + 0.1
    src = NpyRows(_write_npy(tmp_path, x.numpy()))
    models = []
    for train_x in (x, src):
        m = FalkonGP(train_x, y, make_kernel("matern52", 3, torch.float64), num_centers=40, penalty=1e-4, seed=1,
                     tol=1e-12, max_iter=500, store_kernel=store, block_rows=64, learn_centers=True)
        m.fit()
        models.append(m)
    ref, got = models
    assert torch.equal(ref.centers, got.centers)
    torch.testing.assert_close(got.alpha, ref.alpha, rtol=1e-10, atol=1e-10)
    ref.eval(), got.eval()
    with torch.no_grad():
        a, b = ref(test_x), got(test_x)
    torch.testing.assert_close(b.mean, a.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(b.variance, a.variance, rtol=1e-10, atol=1e-10)
    z = torch.randn(301, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    hutchinson = lambda m, block_rows: StochasticNystromCompReg(
        m, trace_vectors=z, ktilde_trace="hutchinson", cg_tol=1e-12, block_rows=block_rows)
    for cls in (SGPRBound, GCV, hutchinson):
        tol = 1e-8 if cls is hutchinson else 1e-10  # CG in the stochastic objective: summation order
        vals, grads = [], []
        for m in (ref, got):
            m.train()
            m.zero_grad()
            loss = cls(m, block_rows=50)()
            loss.backward()
            vals.append(loss.detach())
            grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
        torch.testing.assert_close(vals[1], vals[0], rtol=tol, atol=tol)
        assert set(grads[0]) == set(grads[1]) and "centers" in grads[0]
        for k in grads[0]:
            torch.testing.assert_close(grads[1][k], grads[0][k], rtol=tol, atol=tol)


def test_parquet_source_fits_like_in_memory(tmp_path, data):
    x, y = data
    src = ParquetRows(_write_parquet(tmp_path, x.numpy(), y.numpy()), exclude=["target"])
    fits = [FalkonGP(t, y, make_kernel("matern52", 3, torch.float64), num_centers=30, penalty=1e-4, seed=2, tol=1e-12,
                     max_iter=500, store_kernel=False, block_rows=50).fit() for t in (x, src)]
    torch.testing.assert_close(fits[1].alpha, fits[0].alpha, rtol=1e-10, atol=1e-10)


def test_shards_of_a_source_partition_its_rows(tmp_path, data):
    x, _ = data
    src = TensorRows(x)
    shards = [shard_rows(src, r, 4) for r in range(4)]
    assert all(isinstance(s, SliceRows) for s in shards)
    assert [len(s) for s in shards] == [76, 75, 75, 75]
    torch.testing.assert_close(torch.cat([s[0:len(s)] for s in shards]), x, rtol=0, atol=0)
    assert shard_files(["a", "b", "c"], 1, 2) == ["b"]
    assert shard_files(["a"], 1, 2) == []
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        shard_rows(src, 4, 4)
    assert gpfalkon.shard_range(10, 2, 3) == (7, 10)


def test_file_sources_reject_bad_files_and_arguments_by_name(tmp_path, data):
    x, y = data
    npy = _write_npy(tmp_path, x.numpy(), parts=1)[0]
    cut = tmp_path / "cut.npy"
    cut.write_bytes(npy.read_bytes()[:-500])
    with pytest.raises(ValueError, match=r"cut.npy is truncated: its header says 301 x 3"):
        NpyRows(cut)
    text = tmp_path / "x.csv"
    text.write_text("1,2,3\n")
    with pytest.raises(ValueError, match=r"x.csv is not a .npy file"):
        NpyRows(text)
    with pytest.raises(IsADirectoryError, match=r"is a directory; pass its files \(e.g. sorted\(glob\('.*/\*\.npy'\)"):
        NpyRows(tmp_path)
    paths = _write_parquet(tmp_path, x.numpy(), y.numpy())
    with pytest.raises(IsADirectoryError, match=r"glob\('.*/\*\.parquet'\)"):  # not Spark's _SUCCESS marker
        ParquetRows(tmp_path)
    with pytest.raises(TypeError, match="exclude must be a list"):
        ParquetRows(paths, exclude="target")
    with pytest.raises(ValueError, match=r"exclude names \['Target'\], not columns"):
        ParquetRows(paths, exclude=["Target"])
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    mixed = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"a": [1.0, 2.0], "city": ["x", "y"], "n": [1, 2]}), mixed)
    with pytest.raises(TypeError, match=r"column 'city' of .*mixed.parquet has type string"):
        ParquetRows(mixed)
    src = ParquetRows(mixed, exclude=["city"])
    assert src.columns == ["a", "n"]
    assert torch.equal(src[0:2], torch.tensor([[1.0, 1.0], [2.0, 2.0]], dtype=torch.float64))


def test_an_empty_file_list_is_an_empty_source_of_the_given_shape(tmp_path):
    """A rank that shard_files leaves without files holds an empty source (the README's uneven shards)."""
    assert shard_files(["a.npy"], 1, 2) == []
    src = NpyRows([], d=3, dtype=torch.float32)
    assert len(src) == 0 and src.shape == (0, 3) and src[0:0].shape == (0, 3) and src.dtype == torch.float32
    with pytest.raises(ValueError, match="needs d= and dtype="):
        NpyRows([])
    pq_src = ParquetRows([], columns=["u", "v"])
    assert len(pq_src) == 0 and pq_src.shape == (0, 2) and pq_src.dtype == torch.float64
    with pytest.raises(ValueError, match="needs columns="):
        ParquetRows([])


def test_a_model_on_a_source_trains_with_fit_gpytorch_mll_and_converts_dtype(tmp_path, data):
    """GPyTorch's / BoTorch's training loop calls model(*model.train_inputs) in train mode: on a row source that
    is the prior's mean only, and the MLL's value and gradients are those of the in-memory model. ``.float()``
    reads the source's rows in float32 from then on, as it converts an in-memory train_x."""
    from gpfalkon import NystromMarginalLogLikelihood

    x, y = data
    src = NpyRows(_write_npy(tmp_path, x.numpy()))
    vals, grads = [], []
    for train_x in (x, src):
        m = FalkonGP(train_x, y, make_kernel("matern52", 3, torch.float64), num_centers=30, penalty=1e-4, seed=1)
        mll = NystromMarginalLogLikelihood(m.likelihood, m, objective="sgpr")
        m.train()
        out = m(*m.train_inputs)
        assert out.mean.shape == (301,) and torch.equal(out.mean, torch.zeros(301, dtype=torch.float64))
        loss = -mll(out, m.train_targets)
        loss.backward()
        vals.append(loss.detach())
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.kernel.parameters()]))
    torch.testing.assert_close(vals[1], vals[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
    with pytest.raises(AttributeError, match="has only its mean"):
        out.covariance_matrix  # noqa: B018
    m = FalkonGP(src, y, make_kernel("matern52", 3, torch.float64), num_centers=30, penalty=1e-4, seed=1).fit()
    ref = FalkonGP(x.float(), y.float(), make_kernel("matern52", 3, torch.float32), centers=m.centers.float(),
                   penalty=1e-4).fit().eval()
    m.float().eval()
    assert m.train_inputs[0].dtype == torch.float32 and src.dtype == torch.float64  # the user's source unchanged
    xt = x[:10].float() + 0.05
    torch.testing.assert_close(m(xt).mean, ref(xt).mean, rtol=1e-4, atol=1e-4)
    m.fit()
    torch.testing.assert_close(m(xt).mean, ref(xt).mean, rtol=1e-4, atol=1e-4)


def test_npy_files_of_the_other_byte_order_read_the_same_values(tmp_path, data):
    x, _ = data
    np.save(tmp_path / "le.npy", x.numpy())
    np.save(tmp_path / "be.npy", x.numpy().astype(">f8"))
    src = NpyRows([tmp_path / "be.npy", tmp_path / "le.npy"])
    assert src.dtype == torch.float64 and len(src) == 602
    torch.testing.assert_close(src[0:602], torch.cat([x, x]), rtol=0, atol=0)
    np.save(tmp_path / "none.npy", np.zeros((5, 0)))
    with pytest.raises(ValueError, match="train_x has 0 features"):
        FalkonGP(NpyRows(tmp_path / "none.npy"), torch.zeros(5, dtype=torch.float64), num_centers=2)


@pytest.mark.parametrize("kind", ["npy", "parquet"])
def test_a_file_rewritten_after_fit_is_refused_not_read(tmp_path, kind):
    """A fitted model reads its source again (the variance factors, formed at the first variance request): a file
    rewritten in between (same shape, other rows) is refused by name, not mixed in; a copy or pickle of the source
    keeps watching the files it was opened on. A float32 model's float64 view of the rows does too."""
    import os
    import pickle

    pq = pytest.importorskip("pyarrow.parquet") if kind == "parquet" else None
    x, y = make_data(400, 3)
    for dtype in (torch.float64, torch.float32):
        d = tmp_path / str(dtype)[6:]
        d.mkdir()
        if kind == "npy":
            paths = _write_npy(d, x.numpy())
            src = NpyRows(paths, dtype=dtype)
        else:
            paths = _write_parquet(d, x.numpy(), y.numpy())
            src = ParquetRows(paths, exclude=["target"], dtype=dtype)
        model = FalkonGP(src, y.to(dtype), kernel=make_kernel("rbf", 3, dtype=dtype), num_centers=20,
                         penalty=1e-3).fit().eval()
        xt = x[:5].to(dtype)
        model.posterior_mean(xt)  # the mean needs no pass
        clone = pickle.loads(pickle.dumps(src))
        # rewrite the last file with other rows of the same shape (and a later modification time)
        target = paths[-1]
        stat = os.stat(target)
        if kind == "npy":
            np.save(target, np.load(target) * 0.5)
        else:
            t = pq.read_table(target)
            pa = pytest.importorskip("pyarrow")
            pq.write_table(t.set_column(0, "f0", pa.array(t.column("f0").to_numpy() * 0.5)), target,
                           row_group_size=37)
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        with pytest.raises(ValueError, match=rf"{target.name} changed since the source was opened"):
            model(xt).variance  # noqa: B018
        # the mean needs no pass, but the model was fitted on other rows: refused as an edited tensor's model is
        with pytest.raises(ValueError, match=rf"{target.name} changed since the source was opened"):
            model.posterior_mean(xt)
        with pytest.raises(ValueError, match="changed since the source was opened"):
            clone[0:len(x)]
        # a source built now reads the new rows
        fresh = NpyRows(paths, dtype=dtype) if kind == "npy" else ParquetRows(paths, exclude=["target"], dtype=dtype)
        assert fresh[0:len(x)].shape == x.shape


def test_a_file_replaced_with_the_same_size_and_time_is_refused(tmp_path):
    """Another file of the same size renamed over a source's file with the old modification time (what ``cp -p``,
    ``rsync -a`` or ``tar x`` leave) is refused too: the stamp holds the inode beside size and time."""
    import os

    x = np.random.default_rng(0).standard_normal((50, 3))
    (path,) = _write_npy(tmp_path, x, parts=1)
    src = NpyRows([path])
    other = tmp_path / "other.npy"
    np.save(other, x[::-1].copy())
    st = os.stat(path)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(other).st_size == st.st_size
    os.replace(other, path)
    with pytest.raises(ValueError, match="changed since the source was opened"):
        src[0:50]


def test_check_unchanged_stats_every_file_without_reading(tmp_path):
    """``check_unchanged`` refuses a source (and a shard of it) once any of its files is rewritten, the one it has
    not read yet too; in-memory sources pass."""
    import os

    x = np.random.default_rng(2).standard_normal((60, 3))
    paths = _write_npy(tmp_path, x, parts=3)
    pq_src = ParquetRows(_write_parquet(tmp_path, x, x[:, 0]), exclude=["target"])
    src = NpyRows(paths)
    for s in (src, SliceRows(src, 0, 10), pq_src, TensorRows(torch.from_numpy(x))):
        s.check_unchanged()
    st = os.stat(paths[-1])
    np.save(paths[-1], x[40:] * 2)  # the last file: rows no read so far touched
    os.utime(paths[-1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    for s in (src, SliceRows(src, 0, 10)):
        with pytest.raises(ValueError, match="changed since the source was opened"):
            s.check_unchanged()
    pq_path = pq_src.paths[0]
    st = os.stat(pq_path)
    os.utime(pq_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match="changed since the source was opened"):
        pq_src.check_unchanged()


def test_parquet_reads_are_copies_and_thread_safe(tmp_path):
    """A block read from a ParquetRows is the caller's: editing it in place leaves later reads as they were (they
    returned views of the cached row group); reads from several threads at once return the right rows (pyarrow's
    reader raised, the shared cache could hand one thread another's group)."""
    import threading

    x = np.random.default_rng(1).standard_normal((400, 3))
    src = ParquetRows(_write_parquet(tmp_path, x, x[:, 0]), exclude=["target"])
    blk = src[0:20]
    blk.mul_(0)
    np.testing.assert_array_equal(src[0:20].numpy(), x[:20])
    np.testing.assert_array_equal(src.read(3, 10).numpy(), x[3:10])
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                a = int(rng.integers(0, 390))
                b = a + int(rng.integers(1, 80))
                np.testing.assert_array_equal(src.read(a, b).numpy(), x[a:min(b, 400)])
        except BaseException as exc:  # reported below, by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


class _FreshRows(TensorRows):
    """Rows read as fresh tensors (as a file's are), each read recorded with a weak reference."""

    def __init__(self, x):
        super().__init__(x)
        self.reads = []

    def _read(self, start, stop):
        import weakref

        blk = self.x[start:stop].clone()
        self.reads.append((start, stop, weakref.ref(blk)))
        return blk


def test_objectives_on_a_source_keep_no_block_until_the_backward_pass(data):
    """A checkpointed aggregate pass over a row source reads each block again in the backward pass instead of
    keeping every block's rows alive until it (all n x d of data larger than memory); the value and the gradients
    equal the in-memory model's."""
    from gpfalkon import settings

    x, y = data
    vals, grads = [], []
    for fresh in (False, True):
        src = _FreshRows(x) if fresh else x
        m = FalkonGP(src, y, make_kernel("rbf", 3), num_centers=30, penalty=1e-3, seed=2)
        with settings.memory_budget(2**18), settings.block_rows(40):
            if fresh:
                src.reads.clear()
            for obj in (SGPRBound(m), GCV(m)):
                val = obj()
                if fresh:
                    alive = [r for r in src.reads if r[2]() is not None]
                    assert len(src.reads) >= 8 and len(alive) <= 1, (len(src.reads), len(alive))
                val.backward()
                vals.append(val.detach())
                grads.append(torch.cat([p.grad.reshape(-1).clone() for p in m.kernel.parameters()]))
                m.zero_grad()
    for a, b in zip(vals[:2], vals[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[:2], grads[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_source_is_summarised_once_while_its_rows_are_unchanged(tmp_path):
    """Construction reads a source once (its finiteness), a first fit twice (its pass and the fit tracker's
    fingerprint), a refit and another model's fit once (their pass): the finiteness and the fingerprint are
    remembered (``RowSource.memo``; construction read it twice and every fit four times). The remembered fingerprint
    is the in-memory tensor's; an in-memory source's tensor edited in place is scanned again (a NaN written after a
    fit is found); a file rewritten after a fit is refused, not summarised from memory."""
    import os

    from gpfalkon.models.fit_state import data_fingerprint

    x, y = make_data(600, 3)
    src = _FreshRows(x)

    def passes() -> float:
        out = sum(e - s for s, e, _ in src.reads) / len(x)
        src.reads.clear()
        return out

    kw = dict(kernel=make_kernel("rbf", 3), num_centers=20, penalty=1e-3, seed=0)
    model = FalkonGP(src, y, **kw)
    assert 1 <= passes() < 1.2  # (and the 20 centers' rows)
    model.fit()
    assert 2 <= passes() < 2.2
    model.fit()
    assert 1 <= passes() < 1.2
    other = FalkonGP(src, y * 2, **kw).fit()
    assert 1 <= passes() < 1.3 and bool(other.fitted)
    for a, b in zip(data_fingerprint(src, y), data_fingerprint(x, y), strict=True):
        assert torch.equal(a, b)
    other.eval()
    other.posterior_mean(x[:3])
    x[7, 1] = float("nan")  # the tensor under the source, edited in place
    with pytest.raises(NotFittedError, match="training data changed since fit"):  # its model sees it
        other.posterior_mean(x[:3])
    with pytest.raises(ValueError, match=r"train_x contains NaN or Inf values \(first at row 7\)"):
        FalkonGP(src, y, **kw)
    x[7, 1] = 0.0
    # a pickle starts without the remembered values (an unpickled tensor's version counter and address could
    # match a token computed on other rows)
    import pickle

    plain = TensorRows(x)
    plain.check_finite("x")
    assert "_memo" in vars(plain) and "_memo" not in vars(pickle.loads(pickle.dumps(plain)))
    (path,) = _write_npy(tmp_path, x.numpy(), parts=1)
    npy = NpyRows([path])
    fitted = FalkonGP(npy, y, **kw).fit()
    st = os.stat(path)
    np.save(path, x.numpy() * 0.5)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match="changed since the source was opened"):
        data_fingerprint(npy, y)
    with pytest.raises(ValueError, match="changed since the source was opened"):
        fitted.fit()


def test_scans_of_a_wide_source_stay_within_the_memory_budget():
    """The finiteness check and the fingerprint read blocks of ``scan_rows`` rows (three float64 copies of a block
    within the budget), and a streamed product's blocks count the data's ``d`` columns beside ``M``."""
    from gpfalkon import settings
    from gpfalkon.backend import KernelEngine
    from gpfalkon.backend.blocks import PRODUCT, scan_rows
    from gpfalkon.models.fit_state import data_fingerprint

    x = torch.randn(3000, 400, dtype=torch.float64)
    budget = 2**22
    with settings.memory_budget(budget):
        rows = scan_rows(3000, 400)
        assert 3 * rows * 401 * 8 <= budget and rows >= 1
        src = _FreshRows(x)
        src.check_finite("x")
        data_fingerprint(src, torch.zeros(3000, dtype=torch.float64))
        assert max(e - s for s, e, _ in src.reads) <= rows
        eng = KernelEngine(make_kernel("rbf", 400), _FreshRows(x), x[:20], store=False)
        assert PRODUCT.live_blocks * eng.block_rows * (20 + 400) * 8 <= budget


def test_parquet_rows_keep_a_bounded_number_of_files_open(tmp_path, monkeypatch):
    """A data set of many Parquet files: at most MAX_OPEN_FILES stay open (the least recently read is closed),
    and every row still reads back."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from gpfalkon.backend import sources

    monkeypatch.setattr(sources, "MAX_OPEN_FILES", 3)
    x = np.arange(40 * 2, dtype=np.float64).reshape(40, 2)
    paths = []
    for i in range(10):
        p = tmp_path / f"p{i:02d}.parquet"
        pq.write_table(pa.table({"a": x[4 * i:4 * i + 4, 0], "b": x[4 * i:4 * i + 4, 1]}), p)
        paths.append(p)
    src = ParquetRows(paths, columns=["a", "b"])
    for _ in range(2):
        np.testing.assert_array_equal(src.read(0, 40).numpy(), x)
        assert len(src._handles) <= 3
    np.testing.assert_array_equal(src.read(5, 9).numpy(), x[5:9])


def test_float32_streamed_products_round_as_the_in_memory_ones():
    """A float32 row source's products (no fused kernel) flush their row sums to float64 every FLUSH_ROWS rows as
    the fused kernel does: their error against float64 stays within a few times the in-memory engine's (it was
    25-40x, growing with the block height)."""
    from gpfalkon import settings
    from gpfalkon.backend import KernelEngine

    g = torch.Generator().manual_seed(0)
    x = torch.rand(5003, 4, generator=g, dtype=torch.float64)
    c = x[:300]
    u = torch.randn(300, 1, generator=g, dtype=torch.float64)
    k64 = make_kernel("matern52", 4)
    exact = KernelEngine(k64, x, c, store=False).kmn_k(u)
    k32 = make_kernel("matern52", 4, dtype=torch.float32)
    errs = []
    with settings.block_rows(5003):
        for src in (x.float(), TensorRows(x.float())):
            out = KernelEngine(k32, src, c.float(), store=False).kmn_k(u)
            errs.append(float((out - exact).abs().max() / exact.abs().max()))
    assert errs[1] <= 4 * errs[0] + 1e-7, errs


def test_float32_fit_on_a_stored_source_is_as_accurate_as_in_memory():
    """A float32 fit whose K_nM is stored, on a row source: its first pass (K_Mn y, which fills the store) takes the
    stored rows' products in float64 as every later pass does (settings.wide_products), so its mean's error against a
    float64 fit is the in-memory fit's (it was 7-10x larger: the right-hand side in float32 sums, the system wide)."""
    import gpytorch

    g = torch.Generator().manual_seed(0)
    x = torch.rand(3000, 3, generator=g, dtype=torch.float64).float().double()
    y = (torch.sin(6 * x).sum(-1) + 0.05 * torch.randn(3000, generator=g, dtype=torch.float64)).float().double()
    xt = torch.rand(50, 3, generator=g, dtype=torch.float64)

    def kernel(dtype):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=3)).to(dtype)
        k.base_kernel.lengthscale = 0.2
        return k

    ref = FalkonGP(x, y, kernel=kernel(torch.float64), num_centers=300, penalty=1e-6, tol=1e-12, max_iter=1000).fit()
    want = ref.posterior_mean(xt)
    errs = []
    for src in (x.float(), TensorRows(x.float())):
        m = FalkonGP(src, y.float(), kernel=kernel(torch.float32), centers=ref.centers.float(), penalty=1e-6).fit()
        errs.append(float((m.posterior_mean(xt.float()).double() - want).abs().max()))
    assert errs[1] <= 1.5 * errs[0] + 1e-5, errs


def test_a_models_own_memory_budget_bounds_its_scans_and_its_partial_store():
    """``FalkonGP(..., memory_budget=b)``: the scans of its row source (construction, fit) read blocks within b
    (they took the setting's or the automatic budget), and a partly stored K_nM leaves room for the on-the-fly
    buffers' rows, which hold the data's d columns beside M (stored_rows_for counts them, as the engine does)."""
    from gpfalkon.backend import stored_rows_for

    x = torch.randn(20000, 64, dtype=torch.float64)
    y = torch.randn(20000, dtype=torch.float64)
    budget = 2**20
    src = _FreshRows(x)
    m = FalkonGP(src, y, make_kernel("rbf", 64), num_centers=20, penalty=1e-3, memory_budget=budget)
    assert max(e - s for s, e, _ in src.reads) * 3 * 65 * 8 <= budget
    src.reads.clear()
    m.fit()
    assert max(e - s for s, e, _ in src.reads) * 2 * (20 + 64) * 8 <= budget
    from gpfalkon.backend import KernelEngine

    xw = torch.randn(40000, 64, dtype=torch.float64)
    budget = 48 * 2**20  # K_nM (64 MB) does not fit: the rows beside two 16 MiB buffers are stored
    eng = KernelEngine(make_kernel("rbf", 64), xw, xw[:200], memory_budget=budget)
    assert 0 < eng.stored_rows < 40000
    assert eng.stored_rows == stored_rows_for(40000, 200, 8, budget, d=64)
    assert eng.stored_rows * 200 * 8 + 2 * eng.block_rows * (200 + 64) * 8 <= budget
