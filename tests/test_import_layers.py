"""The package's folders are layers that import downwards only, read from every import statement;
no function or class is defined twice; and a config is refused in one place only.

LAYERS is the one place the order is written (docs/architecture.md describes it). A module may
import its own folder and folders of a lower layer; folders on one layer do not import each other;
the ground-floor leaves import nothing of the package; no two modules import each other, directly
or round a longer circle. Imports inside functions count: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hybridmoe"

# Bottom to top. Each entry is one layer: the folders (or top-level modules) on it.
LAYERS: list[tuple[str, ...]] = [
    ("config",),
    ("parallel", "kernels", "hf", "data"),
    ("quant",),
    ("model",),
    ("analysis", "recipe"),
    ("run",),
    ("train", "rl"),
    ("tools",),
    ("cli",),
    ("__main__",),
]
# Folders that import nothing of the package at all.
LEAVES = ("config", "hf", "kernels")
RANK = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The package module an imported name lands in (`hybridmoe.hf` for `from hybridmoe import hf`)."""
    mods = _modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@cache
def _bound(mod: str) -> set[str]:
    """The names a module binds at its top level (what `from mod import name` can take from it)."""
    path = _modules().get(mod)
    if path is None:
        return set()
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


@cache
def _imports() -> dict[str, set[str]]:
    """module -> the package modules it imports (any statement, at any depth)."""
    out = {}
    for mod, path in _modules().items():
        is_pkg = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                # `from pkg import sub` is an arrow to the module sub; `from pkg import name`, to pkg
                # (a submodule not written yet, behind a lazy import, is no arrow).
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in _modules() else base
                         for a in node.names if f"{base}.{a.name}" in _modules() or a.name in _bound(base)
                         or base not in _modules()]
            for n in names:
                if n.split(".")[0] == "hybridmoe":
                    target = _resolve(n)
                    if target and target != mod and target != "hybridmoe":
                        targets.add(target)
        out[mod] = targets
    return out


def _folder(mod: str) -> str:
    return mod.split(".")[1] if "." in mod else mod


def test_every_folder_has_a_layer():
    folders = {_folder(m) for m in _modules() if m != "hybridmoe"}
    assert folders <= set(RANK), f"folders without a layer in LAYERS: {sorted(folders - set(RANK))}"


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        if mod == "hybridmoe":
            continue
        src = _folder(mod)
        for t in sorted(targets):
            dst = _folder(t)
            if dst == src:
                continue
            if src in LEAVES:
                bad.append(f"{mod} -> {t}: {src}/ imports nothing of the package")
            elif RANK[dst] >= RANK[src]:
                where = "the same layer as" if RANK[dst] == RANK[src] else "a higher layer than"
                bad.append(f"{mod} -> {t}: {dst}/ is on {where} {src}/")
    return bad


def circles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found = []

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                found.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_imports_point_down_only():
    bad = upward_arrows(_imports())
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    found = circles(_imports())
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_checks_see_an_upward_arrow_a_sideways_one_and_a_circle():
    """On the real graph with one wrong arrow added each check fails, naming it."""
    graph = {k: set(v) for k, v in _imports().items()}
    up = {**graph, "hybridmoe.model.moe": graph["hybridmoe.model.moe"] | {"hybridmoe.run.step"}}
    assert upward_arrows(up) == ["hybridmoe.model.moe -> hybridmoe.run.step: run/ is on a higher layer than model/"]
    side = {**graph, "hybridmoe.rl.loop": graph["hybridmoe.rl.loop"] | {"hybridmoe.train.loop"}}
    assert upward_arrows(side) == ["hybridmoe.rl.loop -> hybridmoe.train.loop: train/ is on the same layer as rl/"]
    leaf = {**graph, "hybridmoe.hf.files": graph["hybridmoe.hf.files"] | {"hybridmoe.config.errors"}}
    assert upward_arrows(leaf) == ["hybridmoe.hf.files -> hybridmoe.config.errors: hf/ imports nothing of the package"]
    loop = {**graph, "hybridmoe.run.checkpoint": graph["hybridmoe.run.checkpoint"] | {"hybridmoe.run.step"},
            "hybridmoe.run.step": graph["hybridmoe.run.step"] | {"hybridmoe.run.checkpoint"}}
    assert any("hybridmoe.run.checkpoint -> hybridmoe.run.step -> hybridmoe.run.checkpoint" in c
               or "hybridmoe.run.step -> hybridmoe.run.checkpoint -> hybridmoe.run.step" in c for c in circles(loop))


def _definitions():
    """(where, name, normalised body) of every module-level function and class, and every method,
    of the package; the body without its docstring, names and values kept, positions dropped."""
    for mod, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text())
        scopes = [(node, "") for node in tree.body]
        scopes += [(item, f"{node.name}.") for node in tree.body if isinstance(node, ast.ClassDef)
                   for item in node.body]
        for node, owner in scopes:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if body:
                yield f"{mod}:{node.lineno} {owner}{node.name}", ast.dump(ast.Module(body=body, type_ignores=[]))


def duplicate_definitions(defs) -> list[str]:
    """Groups of definitions with the same body (a body of one short statement does not count:
    `return x` in two places is no second copy of a helper)."""
    by_body: dict[str, list[str]] = {}
    for where, body in defs:
        if len(body) >= 300:
            by_body.setdefault(body, []).append(where)
    return [" = ".join(places) for places in by_body.values() if len(places) > 1]


def test_no_function_or_class_is_defined_twice():
    dups = duplicate_definitions(_definitions())
    assert not dups, "the same definition in two places (keep one, import it):\n" + "\n".join(dups)


def test_the_duplicate_check_sees_a_copied_helper():
    defs = list(_definitions())
    where, body = next((w, b) for w, b in defs if w.endswith(" matmul_highest"))
    assert duplicate_definitions([*defs, ("hybridmoe.kernels.gdn.copy:1 _matmul", body)]) == [
        f"{where} = hybridmoe.kernels.gdn.copy:1 _matmul"]


# The modules that may raise ConfigError: the loaders (a recipe that cannot be read or parsed) and
# the one validation pass. Every other module leaves refusals to them.
CONFIG_ERROR_RAISERS = ("hybridmoe.recipe.load", "hybridmoe.recipe.validate")


def config_error_raises(sources: dict[str, str]) -> list[str]:
    """module:line of every `raise ConfigError...` in `sources` (module -> text)."""
    found = []
    for mod, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            exc = node.exc.func if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) else \
                node.exc if isinstance(node, ast.Raise) else None
            name = exc.id if isinstance(exc, ast.Name) else exc.attr if isinstance(exc, ast.Attribute) else None
            if name == "ConfigError":
                found.append(f"{mod}:{node.lineno}")
    return found


def test_configs_are_refused_by_the_loaders_and_the_validator_only():
    sources = {mod: path.read_text() for mod, path in _modules().items()}
    outside = [w for w in config_error_raises(sources) if w.split(":")[0] not in CONFIG_ERROR_RAISERS]
    assert not outside, f"ConfigError raised outside {CONFIG_ERROR_RAISERS}: {outside}; make it a rule of recipe/validate.py"
    # The check sees a raise added anywhere else.
    sources["hybridmoe.parallel.mesh"] += "\n\ndef f():\n    raise ConfigError([('mesh', 'no')])\n"
    assert [w.split(":")[0] for w in config_error_raises(sources)
            if w.split(":")[0] not in CONFIG_ERROR_RAISERS] == ["hybridmoe.parallel.mesh"]
