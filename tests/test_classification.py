"""FalkonClassifier: +-1 / one-hot targets as right-hand sides, sign / argmax decisions,
checked against the dense Nyström KRR solution."""
import gpytorch
import pytest
import torch

from gpfalkon import FalkonClassifier, encode_labels

from conftest import dense_kernel, dense_nystrom


def _blobs(n_per: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    means = torch.tensor([[0.0, 0.0], [2.0, 0.5], [0.5, 2.0], [2.0, 2.0]])[:k]
    x = torch.cat([means[c] + 0.6 * torch.randn(n_per, 2, generator=g, dtype=torch.float64) for c in range(k)])
    labels = torch.arange(k).repeat_interleave(n_per)
    return x, labels


def _kernel():
    k = gpytorch.kernels.RBFKernel().double()
    k.lengthscale = 0.7
    return k


def test_encode_labels_binary_and_multiclass():
    t, c = encode_labels(torch.tensor([5, 3, 5, 3, 3]))
    assert c.tolist() == [3, 5]
    assert t.tolist() == [1.0, -1.0, 1.0, -1.0, -1.0]
    t, c = encode_labels(torch.tensor([2, 0, 1, 2]))
    assert t.shape == (4, 3)
    assert torch.equal(t.argmax(-1), torch.tensor([2, 0, 1, 2]))
    assert torch.equal(t.sum(-1), torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("k", [2, 4])
def test_classifier_matches_dense_nystrom(k):
    x, labels = _blobs(60, k)
    labels = labels * 10 + 7  # arbitrary label values
    kern = _kernel()
    lam = 1e-3
    clf = FalkonClassifier(x, labels, kern, num_centers=50, penalty=lam, tol=1e-12, max_iter=500, seed=3).fit()
    centers = clf.model.centers
    targets, classes = encode_labels(labels)
    H, knm, _ = dense_nystrom(kern, x, centers, lam)
    alpha = torch.linalg.solve(H, knm.T @ targets.reshape(x.shape[0], -1))
    xq = x[::7] + 0.05
    ref_scores = dense_kernel(kern, xq, centers) @ alpha
    scores = clf.decision_function(xq)
    torch.testing.assert_close(scores.reshape(ref_scores.shape), ref_scores, rtol=1e-7, atol=1e-8)
    if k == 2:
        ref_pred = classes[(ref_scores.squeeze(-1) > 0).long()]
    else:
        ref_pred = classes[ref_scores.argmax(-1)]
    assert torch.equal(clf.predict(xq), ref_pred)
    # separable-ish blobs: the classifier is far better than chance on its training data
    acc = (clf.predict(x) == labels).double().mean()
    assert acc > 0.85


def test_classifier_bad_labels():
    x, labels = _blobs(10, 2)
    with pytest.raises(ValueError, match="labels"):
        FalkonClassifier(x, torch.zeros(20, dtype=torch.long), _kernel())
    with pytest.raises(ValueError, match="labels"):
        FalkonClassifier(x, labels[:-1], _kernel())
    with pytest.raises(ValueError, match="labels"):
        FalkonClassifier(x, torch.full((20,), float("nan"), dtype=torch.float64), _kernel())
    with pytest.raises(ValueError, match="labels"):
        encode_labels(torch.tensor([0, 1, 2]), classes=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="classes must be strictly increasing"):
        encode_labels(torch.tensor([0, 1, 1]), classes=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="classes must be strictly increasing"):
        encode_labels(torch.tensor([0, 1, 2]), classes=torch.tensor([0, 1, 1, 2]))
    with pytest.raises(TypeError, match="labels"):
        FalkonClassifier(x, [0, 1] * 10, _kernel())
    with pytest.raises(TypeError, match="labels"):
        encode_labels(torch.zeros(4, dtype=torch.complex64))


def test_bool_labels_and_given_classes():
    x, labels = _blobs(10, 2)
    t_bool, c_bool = encode_labels(labels.bool())
    t_int, _c_int = encode_labels(labels)
    assert torch.equal(t_bool, t_int) and c_bool.tolist() == [0, 1]
    # given classes (a superset, sorted) code the same labels into more columns
    t3, c3 = encode_labels(labels, classes=torch.tensor([0, 1, 2]))
    assert t3.shape == (20, 3) and bool((t3[:, 2] == 0).all()) and c3.tolist() == [0, 1, 2]
    clf = FalkonClassifier(x, labels.bool(), _kernel(), num_centers=10, penalty=1e-3).fit()
    assert torch.equal(
        clf.predict(x), FalkonClassifier(x, labels, _kernel(), num_centers=10, penalty=1e-3).fit().predict(x)
    )



def test_continuous_float_labels_are_refused_unless_classes_are_given():
    """Issue 15 (part): float labels with non-integer values (regression targets by mistake) raise
    instead of becoming an n-class problem; integer-valued floats and explicit classes still work."""
    y = torch.linspace(0, 1, 30, dtype=torch.float64)
    with pytest.raises(ValueError, match="non-integer values"):
        encode_labels(y)
    targets, classes = encode_labels(torch.tensor([0.0, 2.0, 2.0, 0.0], dtype=torch.float64))
    assert classes.tolist() == [0.0, 2.0] and targets.tolist() == [-1.0, 1.0, 1.0, -1.0]
    halves = torch.tensor([0.5, 1.5, 0.5], dtype=torch.float64)
    targets, classes = encode_labels(halves, classes=torch.tensor([0.5, 1.5], dtype=torch.float64))
    assert targets.tolist() == [-1.0, 1.0, -1.0]


def test_given_classes_are_never_rounded_into_the_labels_dtype():
    """Float classes with integer labels are compared as floats (label 0 is not the class 0.5); classes that the
    labels' dtype cannot hold are refused; .float() / .to() of a classifier keeps its labels exactly."""
    t, c = encode_labels(torch.tensor([0, 1, 1]), classes=torch.tensor([0.0, 0.5, 1.0]))
    assert torch.equal(c, torch.tensor([0.0, 0.5, 1.0])) and t.argmax(-1).tolist() == [0, 2, 2]
    with pytest.raises(ValueError, match="labels contains values not in classes"):
        encode_labels(torch.tensor([0, 1, 1]), classes=torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"cannot be held exactly in the labels' dtype torch\.int8"):
        encode_labels(torch.tensor([0, 0, 44], dtype=torch.int8), classes=torch.tensor([0, 300]))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2, generator=g)
    big = torch.tensor(16777217.0, dtype=torch.float64)  # not a float32 number
    labels = torch.where(x[:, 0].double() > 0, big, torch.zeros((), dtype=torch.float64))
    clf = FalkonClassifier(x, labels, gpytorch.kernels.RBFKernel(), num_centers=20).fit()
    before = clf.predict(x[:8])
    clf.to(torch.float32)
    clf.double()
    assert clf.classes.dtype == torch.float64 and float(clf.classes[1]) == 16777217.0
    torch.testing.assert_close(clf.predict(x[:8].double()), before, rtol=0, atol=0)


def test_integer_labels_that_float_classes_cannot_hold_are_refused():
    """Integer labels compared with float classes: a label the classes' dtype rounds onto another value (2049 in
    float16 is 2048) is refused, not coded as that neighbouring class."""
    with pytest.raises(ValueError, match="held exactly in the classes' dtype"):
        encode_labels(torch.tensor([2048, 2049, 2050]), classes=torch.tensor([2048.0, 2050.0], dtype=torch.float16))
    t, c = encode_labels(torch.tensor([2048, 2050, 2048]), classes=torch.tensor([2048.0, 2050.0], dtype=torch.float16))
    assert t.tolist() == [-1.0, 1.0, -1.0] and c.dtype == torch.float16
