"""The package's layers import downwards only (docs/architecture.md).

Read from every module's imports (module level and inside functions alike): an import of a layer
above, or of a sibling that is not below it, fails with the importing file and line. Folders of
one rank may import each other only where the table says so (none do today).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridmoe"

# Bottom to top; a layer may import its own folder and any layer of a lower rank.
LAYERS: dict[str, int] = {
    "config": 0,
    "parallel": 1,
    "kernels": 2,
    "hf": 3,
    "quant": 3,
    "model": 4,
    "recipe": 5,
    "analysis": 5,
    "data": 5,
    "run": 6,
    "train": 7,
    "rl": 7,
    "tools": 8,
    "cli": 9,
    "__main__": 10,
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "hybridmoe", module
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("hybridmoe"):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names if a.name.startswith("hybridmoe"))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            text = arg.value if isinstance(arg, ast.Constant) else (
                arg.values[0].value if isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant) else "")
            if text.startswith("hybridmoe"):
                out.append((node.lineno, text.rstrip(".")))
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        own = layer_of(".".join(rel.with_suffix("").parts))
        if own == "__init__":
            continue
        for line, module in imports_of(path):
            other = layer_of(module)
            if other == own or other == "__init__":
                continue
            if other not in LAYERS or own not in LAYERS:
                bad.append(f"{rel}:{line}: {module} (a folder the layer table does not know: add it)")
            elif LAYERS[other] >= LAYERS[own]:
                bad.append(f"{rel}:{line}: {own} (rank {LAYERS[own]}) imports {module} (rank {LAYERS[other]})")
    return bad


def test_every_package_folder_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert folders | modules <= set(LAYERS), sorted((folders | modules) - set(LAYERS))


def test_imports_point_down():
    bad = violations()
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The check is not vacuous: a kernel importing the model is reported."""
    fake = tmp_path / "hybridmoe"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "bad.py").write_text("def f():\n    from hybridmoe.model import forward\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert violations() == ["hybridmoe/kernels/bad.py:2: kernels (rank 2) imports hybridmoe.model (rank 4)"]
