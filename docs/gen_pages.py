"""Build-time pages of the documentation site (run by mkdocs-gen-files, ``mkdocs.yml``).

- ``tutorials/<example>.md`` for every script in ``examples/``: its docstring as the text and its
  source; the examples that draw (``plotting.py``, and ``botorch_loop.py`` with ``--plot`` at reduced
  sizes, stated on the page) are also *run* and their figures embedded (about 15 s in all).
- ``benchmarks/<result>.md``: every result page of ``benchmarks/results/`` with its plot, and an
  index of them.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tempfile

import mkdocs_gen_files

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULTS = ROOT / "benchmarks" / "results"


def _docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


# examples run with --plot during the build, at these (reduced) sizes
PLOTTED_RUNS: dict[str, list[str]] = {
    "botorch_loop": ["--iterations", "6", "--init", "12", "--restarts", "2", "--raw-samples", "32"],
}


def _tutorial(path: pathlib.Path, figures: list[str], note: str = "") -> str:
    doc = _docstring(path)
    title, _, rest = doc.partition("\n")
    lines = [f"# {title.strip() or path.stem}", "", rest.strip(), ""]
    if note:
        lines += [note, ""]
    for fig in figures:
        lines += [f"![{fig}]({fig})", ""]
    lines += [f"Source: `examples/{path.name}`", "", "```python", path.read_text().rstrip(), "```", ""]
    return "\n".join(lines)


def tutorials() -> None:
    for path in sorted(EXAMPLES.glob("*.py")):
        figures: list[str] = []
        if path.stem == "plotting":
            import importlib.util

            spec = importlib.util.spec_from_file_location("_plotting_example", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            with tempfile.TemporaryDirectory() as tmp:
                module.make_figures(pathlib.Path(tmp))
                for png in sorted(pathlib.Path(tmp).glob("*.png")):
                    with mkdocs_gen_files.open(f"tutorials/{png.name}", "wb") as f:
                        f.write(png.read_bytes())
                    figures.append(png.name)
        note = ""
        if path.stem in PLOTTED_RUNS:
            args = PLOTTED_RUNS[path.stem]
            with tempfile.TemporaryDirectory() as tmp:
                png = pathlib.Path(tmp) / f"{path.stem}.png"
                subprocess.run([sys.executable, str(path), *args, "--plot", str(png)], check=True,
                               capture_output=True, text=True, cwd=ROOT)
                with mkdocs_gen_files.open(f"tutorials/{png.name}", "wb") as f:
                    f.write(png.read_bytes())
                figures.append(png.name)
            note = ("The figure below was drawn when this site was built: "
                    f"`python examples/{path.name} {' '.join(args)}`.")
        with mkdocs_gen_files.open(f"tutorials/{path.stem}.md", "w") as f:
            f.write(_tutorial(path, figures, note))


def benchmarks() -> None:
    index = ["# Benchmark results", "",
             "Every page below is a result file of `benchmarks/results/`, with the command and the machine "
             "it ran on at its top. The scripts are in `benchmarks/`.", ""]
    for md in sorted(RESULTS.glob("*.md")):
        text = md.read_text()
        png = md.with_suffix(".png")
        if png.exists():
            with mkdocs_gen_files.open(f"benchmarks/{png.name}", "wb") as f:
                f.write(png.read_bytes())
            text += f"\n\n![{png.stem}]({png.name})\n"
        with mkdocs_gen_files.open(f"benchmarks/{md.name}", "w") as f:
            f.write(text)
        first = next((ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("#")), md.stem)
        index.append(f"- [{md.stem}]({md.name}): {first}")
    with mkdocs_gen_files.open("benchmarks/index.md", "w") as f:
        f.write("\n".join(index) + "\n")


tutorials()
benchmarks()
