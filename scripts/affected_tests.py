"""The test files a change touches: those that import a changed module of the package, directly or
through other package modules, plus changed test files, the users of changed test helpers, and the tests that name a changed recipe
or fixture.

  python scripts/affected_tests.py [BASE]     # BASE: a commit (default HEAD: the uncommitted change)

Prints one test file per line (nothing when no test is affected); `make test-quick` runs them.
A change to tests/conftest.py, pyproject.toml or the Makefile affects every test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hybridmoe"
EVERYTHING = {"tests/conftest.py", "pyproject.toml", "Makefile"}


def module_name(path: Path) -> str:
    """hybridmoe/model/moe.py -> hybridmoe.model.moe; tests/helpers.py -> helpers (tests import it so)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[1:] if rel.parts[0] == "tests" else rel.parts
    return ".".join(p for p in parts if p != "__init__") or PACKAGE


def imports(path: Path) -> set[str]:
    """Every module name the file imports (from-imports also name their submodules)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def changed_files(base: str) -> set[str]:
    def git(*args: str) -> list[str]:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return set(git("diff", "--name-only", base)) | set(git("ls-files", "--others", "--exclude-standard"))


def affected(changed: set[str]) -> list[str]:
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    if changed & EVERYTHING:
        return [str(t.relative_to(ROOT)) for t in tests]
    sources = [*(ROOT / PACKAGE).rglob("*.py"), *(ROOT / "tests").glob("*.py")]
    graph = {module_name(p): imports(p) for p in sources}
    # A module is touched when it changed or imports a touched module (to a fixed point).
    touched = {module_name(ROOT / f) for f in changed if f.endswith(".py") and (ROOT / f).exists()
               and (f.startswith(f"{PACKAGE}/") or f.startswith("tests/"))}
    grew = True
    while grew:
        new = {m for m, deps in graph.items() if m not in touched and deps & touched}
        touched |= new
        grew = bool(new)
    # A changed recipe or fixture reaches the tests that name it (recipe=tiny, fixtures/hf_tiny).
    names = {Path(f).stem for f in changed if not f.endswith(".py")} | \
            {Path(f).parent.name for f in changed if f.startswith("tests/fixtures/")}
    return [str(t.relative_to(ROOT)) for t in tests
            if module_name(t) in touched or any(n in t.read_text() for n in names - {"", "fixtures"})]


if __name__ == "__main__":
    print("\n".join(affected(changed_files(sys.argv[1] if len(sys.argv) > 1 else "HEAD"))))
