"""The package map's arrows (shared/DESIGN.md section 1): each package imports only packages
below it. Reads the import statements of every file with ast; runs nothing."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megadyn"
FORBIDDEN = {
    "core": {"models", "data", "elastic", "training", "launch", "bench", "convert"},
    "data": {"core", "models", "elastic", "training", "launch", "bench", "convert"},
    "models": {"elastic", "training", "launch", "bench", "convert"},
    "elastic": {"training", "launch", "bench", "convert"},
    "training": {"launch", "bench", "convert"},
    "launch": {"bench", "convert"},
    "bench": {"convert"},
}
"""package -> the megadyn packages it must not import."""


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(megadyn package, line) of every import of megadyn in `path`, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "megadyn" and len(parts) > 1:
                out.add((parts[1], node.lineno))
    return out


def test_relative_imports_are_not_used():
    """Every import names its package, so the test below sees them all."""
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        relative = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        assert not relative, f"{path.relative_to(ROOT.parent)}: relative import at {relative}"


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_packages_below_it(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"megadyn/{package} has no files"
    wrong = [
        f"{path.relative_to(ROOT.parent)}:{line} imports megadyn.{target}"
        for path in files
        for target, line in sorted(imported_packages(path))
        if target in FORBIDDEN[package]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_an_upward_import(tmp_path):
    path = tmp_path / "example.py"
    path.write_text(
        "import megadyn.core.layout\n"
        "def f():\n"
        "    from megadyn.launch import run\n"
        "    from megadyn import training\n"
    )
    assert imported_packages(path) == {("core", 1), ("launch", 3), ("training", 4)}
