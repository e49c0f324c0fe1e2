"""Layers point one way (the import-linter contracts in pyproject.toml: between the rooms, and inside
runtime/, parity/ and formats/ no circles), the library draws no UI, and nothing in the library
imports the CLI above it."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")


def lint(root: Path) -> subprocess.CompletedProcess:
    """The contract, run over the package found under `root` (a checkout or a copy of one)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contract_holds():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


def _copy_with(tmp_path: Path, module: str, imported: str) -> Path:
    """A copy of the package whose `module` (a path under eagle31_export/) also imports `imported`."""
    shutil.copytree(ROOT / "eagle31_export", tmp_path / "eagle31_export",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "eagle31_export" / module
    path.write_text(path.read_text() + f"\n\ndef _back_import():\n    import {imported}  # noqa: F401\n")
    return tmp_path


def test_an_upward_import_breaks_the_contract(tmp_path):
    """A lower layer importing a higher one (formats -> parity) in a copy of the package is caught."""
    result = lint(_copy_with(tmp_path, "formats/target/checkpoint.py", "eagle31_export.parity.compare"))
    assert result.returncode == 1, result.stdout
    assert "eagle31_export.formats is not allowed to import eagle31_export.parity" in result.stdout
    assert "eagle31_export.formats.target.checkpoint -> eagle31_export.parity.compare" in result.stdout


# Each circle that once was, brought back in a copy: the room's own contracts fail on it.
BACK_IMPORTS = {
    "runtime": ("runtime/contract.py", "eagle31_export.runtime.registry", "runtime/: registry, runtimes"),
    "parity": ("parity/prompts.py", "eagle31_export.parity.sides", "parity/: sides, reports"),
    "formats": ("formats/nvfp4/model.py", "eagle31_export.formats.target.checkpoint", "formats/: pair and capture"),
}


@pytest.mark.parametrize("room", sorted(BACK_IMPORTS))
def test_a_back_import_inside_a_room_breaks_its_contracts(tmp_path, room):
    module, imported, layers = BACK_IMPORTS[room]
    result = lint(_copy_with(tmp_path, module, imported))
    assert result.returncode == 1, result.stdout
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(layers) for line in broken), broken
    assert any(line.startswith("No circles inside") for line in broken), broken


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("forbidden", ["eagle31_export.cli", "rich"])
def test_the_library_imports_neither_the_cli_nor_a_ui(forbidden):
    """UI (rich tables, progress bars) is drawn in cli/ only; the library reports through callbacks."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "eagle31_export").rglob("*.py")
                 if any(n == forbidden or n.startswith(forbidden + ".") for n in _imported_names(p))]
    assert offenders == []


def test_a_library_module_importing_the_sabotage_library_breaks_the_contract(tmp_path):
    """The broken copies sit on the top layer: inspection (or any library module) importing them is caught."""
    result = lint(_copy_with(tmp_path, "inspection.py", "eagle31_export.sabotage"))
    assert result.returncode == 1, result.stdout
    assert "eagle31_export.inspection is not allowed to import eagle31_export.sabotage" in result.stdout
