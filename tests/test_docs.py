"""The docs point at things that exist, and the figures page is the records' own rendering.

docs/levers.md is how a newcomer finds a lever's code, rule, proofs and record in one step: every
path, function, validator rule and test it names must exist. docs/performance.md is generated from
benchmarks/records/ and must equal the generator's output, so no figure in it can go stale.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"`((?:hybridmoe|tests|benchmarks|docs|scripts)/[^`\s:]+)(?:(::|: )([A-Za-z_][A-Za-z0-9_]*))?")


@cache
def _defined(path: Path) -> set[str]:
    """Every function, class and module-level name a Python file defines (at any depth)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _references(doc: str):
    for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        for m in PATH.finditer(line):
            yield n, m.group(1), m.group(3)


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_function_and_test_a_doc_names_exists(doc):
    missing = []
    for n, path, name in _references(doc):
        target = ROOT / path.rstrip(".,;")
        if any(c in path for c in "*{<"):  # a pattern (runs/*, N.orbax-checkpoint-tmp*), not a file
            continue
        if not target.exists():
            missing.append(f"{doc}:{n}: {path} does not exist")
        elif name and target.suffix == ".py" and name not in _defined(target):
            missing.append(f"{doc}:{n}: {path} defines no {name}")
    assert not missing, "\n".join(missing)


def _lever_rows():
    for line in (ROOT / "docs" / "levers.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 7 and cells[0].startswith("`"):
            yield cells


def test_levers_table_rows_name_real_keys_and_rules():
    from hybridmoe.config.schema import Config
    from hybridmoe.recipe.validate import RULES

    rules = {fn.__name__: fn.keys for fn in RULES}
    rows = list(_lever_rows())
    assert len(rows) >= 25
    problems = []
    for key_cell, _what, code, rule_cell, proofs, _record, _measured in rows:
        keys = [k.split("=")[0] for k in re.findall(r"`([a-z0-9_.=]+)", key_cell + " " + rule_cell)
                if not k.startswith("_")]
        section = keys[0].rsplit(".", 1)[0]
        for key in keys:
            full = key if "." in key else f"{section}.{key}"  # `kernels.gmm.tiling`, `tm`, ...
            node = Config
            for part in full.split("."):
                fields = getattr(node, "model_fields", {})
                if part not in fields:
                    problems.append(f"{key_cell}: {full} is not a config key")
                    break
                node = fields[part].annotation
        for rule in re.findall(r"`(_[A-Za-z0-9_]+)`", rule_cell):
            if rule not in rules:
                problems.append(f"{key_cell}: no validator rule {rule}")
            elif not any(k in rules[rule] or k.split(".")[0] in rules[rule] for k in keys):
                problems.append(f"{key_cell}: rule {rule} does not declare it (declares {rules[rule]})")
        if not rule_cell.startswith("-") and not re.search(r"`_[A-Za-z0-9_]+`", rule_cell):
            problems.append(f"{key_cell}: no validator rule named (write - and why when it has none)")
        if "hybridmoe/" not in code:
            problems.append(f"{key_cell}: no code path")
        if "::test_" not in proofs:
            problems.append(f"{key_cell}: no proof test")
    assert not problems, "\n".join(problems)


def test_performance_page_equals_the_records_rendering():
    spec = importlib.util.spec_from_file_location("make_performance_doc",
                                                  ROOT / "benchmarks" / "make_performance_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "performance.md").read_text() == gen.render(), (
        "docs/performance.md is stale: run python benchmarks/make_performance_doc.py")
