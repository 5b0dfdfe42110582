"""The floors of the package as pyproject.toml's import-linter contract states them: every import
points down and no import closes a cycle (imports inside functions counted). A broken contract
names the import; the contract itself is shown to catch an upward import in a copy of the tree."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")
ROOT = Path(__file__).resolve().parents[1]


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the pagelm package of `tree` with `tree`'s pyproject.toml."""
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                                     "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)


def test_the_tree_keeps_its_floors():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("importer, line, named", [
    ("formats/gguf.py", "import pagelm.serve.metrics", "pagelm.formats.gguf -> pagelm.serve.metrics"),
    ("models/__init__.py", "from pagelm.engine import model", "pagelm.models -> pagelm.engine.model"),
])
def test_an_upward_import_breaks_the_contract(tmp_path, importer, line, named):
    shutil.copytree(ROOT / "pagelm", tmp_path / "pagelm", ignore=shutil.ignore_patterns("__pycache__", "ui"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / "pagelm" / importer
    target.write_text(target.read_text() + f"\n\ndef late():\n    {line}\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert named in result.stdout
