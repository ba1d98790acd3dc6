"""Every ``python`` code block of README.md runs, in order, in one namespace (as a user pasting them
into one session would), on small synthetic data.

The names the README leaves to the user (``train_x``, ``train_X``, ``bounds``, ``load_rows``...)
are defined below. Sizes the README quotes for real data (``num_centers=2000``, ``budget=120``,
100 Adam steps...) are scaled down by exact text replacements; each replacement must match, so a
README edit that changes them fails here instead of going untested. ``bash`` blocks are not run
(the two setup commands are CI's own; ``torchrun`` launches are covered by examples/distributed_fit.py's
test).
"""
from __future__ import annotations

import pathlib
import re
import socket

import pytest
import torch
import torch.distributed as dist

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# README text -> small-data text (every key must occur)
SCALE_DOWN: dict[str, str] = {
    "num_centers=2000": "num_centers=120",
    "num_centers=1000": "num_centers=80",
    "num_centers=500": "num_centers=60",
    "leverage_centers(train_x, 2000,": "leverage_centers(train_x, 120,",
    "budget=120": "budget=8",
    "budget=30": "budget=4",
    "suggest(q=4)": "suggest(q=2)",
    "Integer(100, 20000, log=True)": "Integer(20, 200, log=True)",
    "range(100)": "range(3)",
    "num_trace_vectors=20": "num_trace_vectors=4",
    "num_samples=4096": "num_samples=256",
    "num_restarts=10, raw_samples=512": "num_restarts=2, raw_samples=32",
    "num_restarts=10, raw_samples=256": "num_restarts=2, raw_samples=32",
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def user_data() -> dict[str, object]:
    """What the README's snippets assume the user has."""
    g = torch.Generator().manual_seed(0)
    d, n = 3, 600
    f = lambda x: torch.sin(3 * x[:, 0]) + x[:, 1] * x[:, 2]
    x = torch.rand(n + 200, d, generator=g, dtype=torch.float64)
    y = f(x) + 0.05 * torch.randn(n + 200, generator=g, dtype=torch.float64)

    def load_rows(start: int, stop: int):
        return x[start:stop], y[start:stop]

    return {
        "d": d,
        "train_x": x[:n], "train_y": y[:n], "val_x": x[n:n + 100], "val_y": y[n:n + 100], "test_x": x[n + 100:],
        "x": x[:n], "y": y[:n], "centers": x[:50].clone(),
        "labels": (y[:n] > y[:n].median()).long(),
        "train_X": x[:200], "train_Y": y[:200].unsqueeze(-1),
        "bounds": torch.tensor([[0.0] * d, [1.0] * d], dtype=torch.float64),
        "n_total": n, "load_rows": load_rows,
    }


def test_readme_blocks_are_found_and_scaled() -> None:
    text = README.read_text()
    missing = [k for k in SCALE_DOWN if k not in text]
    assert not missing, f"README no longer contains {missing}: update SCALE_DOWN"
    assert len(python_blocks(text)) >= 9


def test_every_readme_python_block_runs(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    for old, new in SCALE_DOWN.items():
        text = text.replace(old, new)
    monkeypatch.chdir(tmp_path)  # the snippets may save files (model.pt)
    with socket.socket() as s:  # the distributed snippet: a 1-process group from torchrun's variables
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    namespace: dict[str, object] = user_data()
    try:
        for i, block in enumerate(python_blocks(text)):
            try:
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"README python block {i} failed: {type(exc).__name__}: {exc}\n{block}") from exc
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # the snippets computed what they say
    assert namespace["pred"].mean.shape == namespace["test_x"].shape[:1]
    assert (tmp_path / "model.pt").exists()


GETTING_STARTED = README.parent / "docs" / "getting-started.md"
DOCS_SCALE_DOWN: dict[str, str] = {
    "num_centers=2000": "num_centers=120",
    "num_centers=1000": "num_centers=80",
    "num_centers=500": "num_centers=60",
    "budget=120": "budget=8",
    "range(100)": "range(3)",
    "Integer(100, 20000, log=True)": "Integer(20, 200, log=True)",
    "suggest(q=4)": "suggest(q=2)",
}


def test_every_getting_started_block_runs(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documentation site's getting-started page, like the README: every python block, in order."""
    import matplotlib

    matplotlib.use("Agg")
    text = GETTING_STARTED.read_text()
    missing = [k for k in DOCS_SCALE_DOWN if k not in text]
    assert not missing, f"docs/getting-started.md no longer contains {missing}: update DOCS_SCALE_DOWN"
    for old, new in DOCS_SCALE_DOWN.items():
        text = text.replace(old, new)
    monkeypatch.chdir(tmp_path)  # the search saves search.json
    namespace: dict[str, object] = user_data()
    namespace["evaluate"] = lambda config: float(config["penalty"]) ** 0.1  # a user's objective
    namespace["seconds"] = 1.5
    blocks = python_blocks(text)
    assert len(blocks) >= 5
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"getting-started.md python block {i}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"getting-started python block {i} failed: {type(exc).__name__}: {exc}\n{block}") \
                from exc
    assert len(namespace["search"].history) == 2 and (tmp_path / "search.json").exists()


def test_quickstart_example_runs() -> None:
    """examples/quickstart.py (the README's main job), small sizes: fixed hyperparameters and auto_fit."""
    import subprocess
    import sys

    root = README.parent
    for args in (["--centers", "200", "--iterations", "30"], ["--auto", "6"]):
        out = subprocess.run([sys.executable, str(root / "examples" / "quickstart.py"), *args], capture_output=True,
                             text=True, timeout=300, cwd=root)
        assert out.returncode == 0, out.stderr[-3000:]
        m = re.search(r"test RMSE ([0-9.]+) \(predicting the training mean: ([0-9.]+)\), NLPD ([-0-9.]+)", out.stdout)
        assert m, out.stdout
        rmse, base = float(m.group(1)), float(m.group(2))
        assert rmse < 0.9 * base, out.stdout  # well below predicting the mean
