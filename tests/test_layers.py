"""The house's layers (issue 32): packages by concept, dependencies one way, enforced by
import-linter's contracts in pyproject.toml (``[tool.importlinter]``)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUNER = ROOT / "tuner"


def test_import_linter_contracts_are_kept():
    """No upward import between packages, the memory model imports no torch/vLLM, the daemon's
    modules import neither: ``lint-imports`` exits 0 with every contract KEPT."""
    out = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports())"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout
    assert out.stdout.count(" KEPT") == 3


def test_no_module_left_at_the_top_level_but_the_face_the_errors_and_the_cli():
    top = sorted(p.name for p in TUNER.glob("*.py"))
    assert top == ["__init__.py", "cli.py", "errors.py"]


def test_every_package_says_its_job_and_what_it_may_import():
    packages = sorted(p.parent for p in TUNER.glob("*/__init__.py"))
    assert len(packages) >= 15
    for init in (p / "__init__.py" for p in packages):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init}: no docstring"
        if init.parent.name not in ("commands", "deploy", "engine", "measure"):
            assert "May import" in doc, f"{init}: the docstring does not say what the package may import"


def test_the_layers_contract_names_every_package():
    """A new package must take its place in the layers contract (else nothing checks it)."""
    text = (ROOT / "pyproject.toml").read_text()
    layers = text.split('type = "layers"', 1)[1].split("]", 1)[0]
    for init in TUNER.glob("*/__init__.py"):
        if init.parent.name == "data":
            continue
        assert re.search(rf"(?<![\w.])tuner\.{init.parent.name}(?![\w.])", layers), \
            f"tuner.{init.parent.name} is in no layer"


def test_no_function_over_120_lines():
    """Stages instead of long functions (issue 32: explain_point was 283 lines, load_model_spec 204,
    run_check 190, run_job 179, evaluate 154): every function in tuner/ and plugins/ is at most 120
    lines, docstring included."""
    long = []
    for path in sorted([*TUNER.rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 120:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
