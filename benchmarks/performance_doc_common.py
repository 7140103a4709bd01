"""What every section of docs/performance.md is written with (benchmarks/make_performance_doc.py and
benchmarks/performance_doc_program.py): where the records are, reading one, a Markdown table, the
line naming a figure's record and command, number formats."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECORDS = ROOT / "benchmarks" / "records"
DOC = ROOT / "docs" / "performance.md"
MiB, GiB = 2**20, 2**30
# The commands name the PyTorch reference's interpreter by the venv benchmarks/reference/setup.sh makes.
REFERENCE_PYTHON = "REFERENCE_VENV/bin/python"

def load(name: str) -> dict:
    return json.loads((RECORDS / name).read_text())


def table(headers: list[str], rows: list[list]) -> str:
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"  # noqa: E731
    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)])


def source(rec: dict, name: str, command: str) -> str:
    """Where a figure comes from: the record, the command that regenerates it, and the record's own
    date, commit, machine and versions."""
    machine = rec.get("machine", {})
    if isinstance(machine, dict):
        cpu = machine.get("cpu") or machine.get("host") or ""
        cores = machine.get("cores") or machine.get("cpu_count") or machine.get("logical_cpus")
        machine = f"{cpu}, {cores} cores" if cores else cpu
    versions = rec.get("versions", {})
    vs = ", ".join(f"{k} {v}" for k, v in versions.items()) if isinstance(versions, dict) else ""
    commit = (rec.get("commit") or "")[:7] or "-"
    return (f"Record `benchmarks/records/{name}` (`{command}`); {rec.get('date', '-')[:10]}, commit {commit}, "
            f"{machine or '-'}; {vs}.")


def f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def mib(b):
    return f"{b / MiB:.1f}"


def gib(b):
    return f"{b / GiB:.2f}"
