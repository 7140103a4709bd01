"""Reading JSONL and Parquet files into records, with bad lines counted and located.

JSONL is read with the standard library line by line, so a bad line is reported with its line
number and the rest of the file still read (a columnar JSON reader fails a whole block at once).
Parquet is read with pyarrow, the reference implementation of the format (`datasets` would add a
cache folder, hub machinery and a dozen dependencies on top of the same pyarrow reader); its
"line" numbers are 1-based row numbers.

Every record keeps its file and line, so any later error (a missing field, text the tokenizer
rejects) can name them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A data file that cannot be used as configured; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Record:
    fields: dict[str, Any]
    file: str
    line: int  # 1-based line (JSONL) or row (Parquet)


@dataclass
class BadLines:
    """Lines that were skipped: how many, and where the first one was and why."""
    count: int = 0
    first: str = ""

    def add(self, file: str, line: int, why: str) -> None:
        if not self.count:
            self.first = f"{file}:{line}: {why}"
        self.count += 1


def data_files(path: str | Path, what: str) -> list[Path]:
    """A file, or the JSONL/Parquet files of a folder in name order."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES)
        if not files:
            raise DataError(f"{what}={path}: the folder holds no {'/'.join(SUFFIXES)} files")
        return files
    if not p.is_file():
        raise DataError(f"{what}={path}: no such file or folder")
    if p.suffix not in SUFFIXES:
        raise DataError(f"{what}={path}: expected a {'/'.join(SUFFIXES)} file (JSON lines or Parquet)")
    return [p]


def _jsonl_rows(file: Path):
    with open(file, encoding="utf-8", errors="strict") as fh:
        try:
            for number, line in enumerate(fh, 1):
                line = line.rstrip("\r\n")  # else an error at the end of the line is "line 2 column 1"
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line), None
                except json.JSONDecodeError as e:
                    where = "the end of the line" if e.pos >= len(line) else f"column {e.pos + 1}"
                    yield number, None, f"not valid JSON ({e.msg} at {where})"
        except UnicodeDecodeError as e:
            raise DataError(f"{file}: not UTF-8 text ({e}); JSON lines files are UTF-8") from None


def _parquet_rows(file: Path):
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(file)
    except Exception as e:  # noqa: BLE001 -- pyarrow raises ArrowInvalid/OSError for damaged files
        raise DataError(f"{file}: not a readable Parquet file ({e}); write it again") from None
    for number, row in enumerate(table.to_pylist(), 1):
        yield number, row, None


def read_records(path: str | Path, what: str, check: Callable[[dict], str | None],
                 on_bad_line: Literal["stop", "skip"]) -> tuple[list[Record], BadLines]:
    """Every record of the file(s) that `check` accepts (check returns why a record is bad, or None).

    on_bad_line="stop": one DataError naming the first bad line and the number of bad lines in all.
    on_bad_line="skip": the bad lines are left out, counted and logged once.
    """
    records, bad = [], BadLines()
    for file in data_files(path, what):
        rows = _parquet_rows(file) if file.suffix == ".parquet" else _jsonl_rows(file)
        for number, row, why in rows:
            if why is None and not isinstance(row, dict):
                why = f"expected a JSON object, got {type(row).__name__}"
            if why is None:
                why = check(row)
            if why is not None:
                bad.add(str(file), number, why)
                continue
            records.append(Record(row, str(file), number))
    if bad.count and on_bad_line == "stop":
        raise DataError(f"{what}: {bad.count} bad line(s); the first is {bad.first}. Fix the file, or pass "
                        "data.on_bad_line=skip to leave such lines out")
    if bad.count:
        log.warning("%s: skipped %d bad line(s); the first is %s", what, bad.count, bad.first)
    if not records:
        raise DataError(f"{what}={path}: no usable records" + (f" ({bad.count} bad, first {bad.first})" if bad.count else ""))
    return records, bad


def text_or_messages(text_field: str) -> Callable[[dict], str | None]:
    """The check of a training document: a string `text_field`, or a `messages` list of {role, content}."""
    def check(row: dict) -> str | None:
        if isinstance(row.get(text_field), str):
            return None
        if "messages" in row:
            return _messages_problem(row["messages"])
        return f"no {text_field!r} string and no 'messages' list (fields: {', '.join(sorted(row)) or 'none'})"
    return check


def prompt_or_messages(row: dict) -> str | None:
    """The check of a prompt-set line: a `prompt` string, or a `messages` list of {role, content}."""
    if isinstance(row.get("prompt"), str):
        return None
    if "messages" in row:
        return _messages_problem(row["messages"])
    return f"no 'prompt' string and no 'messages' list (fields: {', '.join(sorted(row)) or 'none'})"


def _messages_problem(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {role, content} objects"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"messages[{i}] must be an object with string 'role' and 'content'"
    return None
