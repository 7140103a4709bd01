"""The docs point at things that exist, stand on their own, and the figures page is the records' own rendering.

docs/levers.md is how a newcomer finds a lever's code, rule, proofs and record in one step: every
path, function, config key, validator rule and test it names must exist. Every `*.md` that the code,
the tests, the benchmarks, the scripts or the docs name is in the repository (a derivation the code
cites lives in docs/), and the docs cite no tracker issue and no machine's folders.
docs/performance.md is generated from benchmarks/records/ and must equal the generator's output, so
no figure in it can go stale.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
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


def _lever_sections():
    """(heading, {field: text}) for every `### `key`` section of docs/levers.md; a field is a
    `- Name: text` bullet with its indented continuation lines."""
    sections, fields, field = [], None, None
    for line in (ROOT / "docs" / "levers.md").read_text().splitlines():
        if line.startswith("#"):
            fields = field = None
            if line.startswith("### `"):
                fields = {}
                sections.append((line[4:], fields))
        elif fields is not None and (m := re.match(r"- ([A-Z][a-z ]+): (.*)", line)):
            field = m.group(1).lower()
            fields[field] = m.group(2)
        elif fields is not None and field and line.startswith("  "):
            fields[field] += " " + line.strip()
        elif not line.strip():
            field = None
    return sections


LEVER_FIELDS = ("code", "validator", "proofs", "broken variants", "measured")


def test_every_lever_section_names_its_key_rule_code_proofs_variants_and_record():
    from hybridmoe.config.schema import Config
    from hybridmoe.recipe.validate import RULES

    rules = {fn.__name__: fn.keys for fn in RULES}
    sections = _lever_sections()
    assert len(sections) >= 25
    problems = []
    for heading, fields in sections:
        missing = [f for f in LEVER_FIELDS if not fields.get(f)]
        if missing:
            problems.append(f"{heading}: no {', '.join(missing)} (write `- Name: text` bullets)")
            continue
        validator = fields["validator"]
        keys = [k.split("=")[0] for k in re.findall(r"`([a-z0-9_.=]+)`", heading + " " + validator)
                if not k.startswith("_")]
        section = keys[0].rsplit(".", 1)[0]
        for key in keys:
            full = key if "." in key else f"{section}.{key}"  # `kernels.gmm.tiling`, `tm`, ...
            node = Config
            for part in full.split("."):
                fields_of = getattr(node, "model_fields", {})
                if part not in fields_of:
                    problems.append(f"{heading}: {full} is not a config key")
                    break
                node = fields_of[part].annotation
        named_rules = re.findall(r"`(_[A-Za-z0-9_]+)`", validator)
        for rule in named_rules:
            if rule not in rules:
                problems.append(f"{heading}: no validator rule {rule}")
            elif not any(k in rules[rule] or k.split(".")[0] in rules[rule] for k in keys):
                problems.append(f"{heading}: rule {rule} does not declare it (declares {rules[rule]})")
        if not named_rules and not validator.startswith("none"):
            problems.append(f"{heading}: no validator rule named (write `none` and why when it has none)")
        if "hybridmoe/" not in fields["code"]:
            problems.append(f"{heading}: no code path")
        if "::test_" not in fields["proofs"]:
            problems.append(f"{heading}: no proof test")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS)
def test_no_line_of_a_doc_is_a_wall(doc):
    """A doc is read in an editor and in a diff: a line over LONGEST_LINE characters is a table row or
    a paragraph that wants wrapping (generated tables included)."""
    long = [f"{doc}:{n}: {len(line)} characters" for n, line in
            enumerate((ROOT / doc).read_text().splitlines(), 1) if len(line) > LONGEST_LINE]
    assert not long, "\n".join(long)


LONGEST_LINE = 600


# Where a reader may meet the name of a markdown file: the code, the tests, the benchmarks and
# scripts, the docs and the README.
CITING = ("hybridmoe", "tests", "benchmarks", "scripts")
MD_NAME = re.compile(r"(?<![\w./+-])((?:\.\./|\./)?[A-Za-z0-9_][A-Za-z0-9_./+-]*\.md)\b")


@cache
def _repository_files() -> tuple[str, ...]:
    """The repository's files relative to its root: git's list where there is a checkout, else the
    files on disk outside hidden folders, virtual environments and run outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return tuple(sorted(set(out.splitlines())))
    except (OSError, subprocess.CalledProcessError):
        skip = {"runs", "__pycache__", "node_modules"}
        return tuple(sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                            and not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)))


def _citing_files() -> list[str]:
    return [f for f in _repository_files()
            if (f.split("/")[0] in CITING and f.endswith((".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".txt")))
            or (f.startswith("docs/") and f.endswith(".md")) or f == "README.md"]


def missing_markdown(files) -> list[str]:
    """Every `*.md` named in `files` that is not in the repository: a name with a folder is resolved
    from the repository root (or, for ./ and ../, from the citing file's folder); a bare name must be
    the name of some file of the repository."""
    repo = set(_repository_files())
    names = {Path(f).name for f in repo}
    missing = []
    for f in files:
        for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1):
            for m in MD_NAME.finditer(line):
                name = m.group(1)
                if "://" in line[line.rfind(" ", 0, m.start()) + 1:m.end()]:
                    continue  # part of a URL
                if name.startswith(("./", "../")):
                    found = os.path.normpath(os.path.join(os.path.dirname(f), name)) in repo
                elif "/" in name:
                    found = name in repo
                else:
                    found = name in names
                if not found:
                    missing.append(f"{f}:{n}: {name} is not in the repository")
    return missing


def test_every_markdown_file_named_in_code_tests_and_docs_exists():
    files = _citing_files()
    assert "README.md" in files and "hybridmoe/model/gdn.py" in files
    missing = missing_markdown(files)
    assert not missing, "\n".join(missing)


ISSUE_NUMBER = re.compile(r"\b[Ii]ssues?\s+#?\d+|(?<![\w&/])#\d+\b")
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|Users)/")


@pytest.mark.parametrize("doc", DOCS)
def test_no_issue_numbers_or_machine_paths_in_docs(doc):
    """The docs stand on their own: they cite no tracker issue and no folder of one machine."""
    found = [f"{doc}:{n}: {line.strip()[:120]}" for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1)
             if ISSUE_NUMBER.search(line) or MACHINE_PATH.search(line)]
    assert not found, "\n".join(found)


def test_no_issue_numbers_in_code_tests_or_scripts():
    """Code, tests, benchmarks and scripts say why in their own words, never by a tracker's number
    (benchmark records are data and are not read)."""
    files = [f for f in _citing_files() if f.split("/")[0] in CITING and "/records/" not in f]
    assert "hybridmoe/model/gdn.py" in files and "tests/broken_variants.py" in files
    found = [f"{f}:{n}: {line.strip()[:120]}" for f in files
             for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if ISSUE_NUMBER.search(line)]
    assert not found, "\n".join(found)


CONFLICT_MARKER = re.compile(r"^(<{7} |={7}$|>{7} )")


def test_no_merge_conflict_is_left_in_a_doc_or_source_file():
    """A merge's conflict markers once landed in docs/tpu.md, both sides of the conflict shown to readers."""
    files = DOCS + [f for f in _citing_files() if "/records/" not in f]
    assert "docs/tpu.md" in files and "hybridmoe/model/gdn.py" in files
    found = [f"{f}:{n}: {line[:60]}" for f in files
             for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if CONFLICT_MARKER.match(line)]
    assert not found, "\n".join(found)


def test_performance_page_equals_the_records_rendering():
    spec = importlib.util.spec_from_file_location("make_performance_doc",
                                                  ROOT / "benchmarks" / "make_performance_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "performance.md").read_text() == gen.render(), (
        "docs/performance.md is stale: run python benchmarks/make_performance_doc.py")
