"""Per-step metrics: a JSON-lines file that survives kills, TensorBoard mirrors, and a PNG plot.

metrics.jsonl holds one object per step, {"step": n, "key": value, ...}. Each line is flushed and
fsynced as it is written, so a killed run loses at most the line in flight (a torn last line is
dropped on resume). A resumed run restarts from its last checkpoint, which is usually behind the
last logged step: `resume_from_step` first rewrites the file without the records at or past that
step (temp file + os.replace, so a second kill during the rewrite leaves either the old file or the
new one, never half of each), and the TensorBoard events are rebuilt from the kept records. Events
are flushed with every record, so TensorBoard and metrics.jsonl hold the same steps at any moment.

Non-finite values are written as JSON null (strict JSON readers reject NaN) and skipped in
TensorBoard; a NaN loss is then still visible as a gap in the record.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

JSONL_NAME = "metrics.jsonl"
TB_DIR_NAME = "tb"
PNG_NAME = "metrics.png"


def read_metrics(jsonl_path: Path) -> list[dict]:
    """Every well-formed record; a torn or corrupt line (a kill mid-write) is skipped with a warning."""
    records = []
    with open(jsonl_path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: unreadable metrics line dropped (%r)", jsonl_path, line_no, line[:80])
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def _replace_atomically(path: Path, write) -> None:
    """Write through `write(tmp_path)` to a temp file beside `path`, fsync, then os.replace."""
    tmp_path = path.with_name(f".{path.name}.tmp")
    write(tmp_path)
    with open(tmp_path, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


class MetricsWriter:
    """Appends step records to out_dir/metrics.jsonl and mirrors them to out_dir/tb."""

    def __init__(self, out_dir: Path, *, resume_from_step: int | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.out_dir / JSONL_NAME
        kept = []
        if resume_from_step is not None and self.jsonl_path.exists():
            kept = self._truncate(resume_from_step)
        self._file = open(self.jsonl_path, "a", encoding="utf-8")
        if self._file.tell() > 0 and not self._ends_with_newline():
            self._file.write("\n")  # a torn last line from a kill: start ours on a fresh line

        from tensorboardX import SummaryWriter  # heavy import (protobuf): only when writing

        tb_dir = self.out_dir / TB_DIR_NAME
        if resume_from_step is not None and tb_dir.exists():
            shutil.rmtree(tb_dir)  # rebuilt below from the records kept: the two never disagree
        self._tb = SummaryWriter(logdir=str(tb_dir))
        for record in kept:
            self._add_scalars(record)
        self._tb.flush()

    def _ends_with_newline(self) -> bool:
        with open(self.jsonl_path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _truncate(self, resume_from_step: int) -> list[dict]:
        kept = [r for r in read_metrics(self.jsonl_path) if r["step"] < resume_from_step]

        def write(tmp_path: Path) -> None:
            with open(tmp_path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)

        _replace_atomically(self.jsonl_path, write)
        return kept

    def _add_scalars(self, record: Mapping) -> None:
        for key, value in record.items():
            if key != "step" and value is not None:
                self._tb.add_scalar(key, value, global_step=int(record["step"]))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        record: dict[str, int | float | None] = {"step": int(step)}
        for key, value in metrics.items():
            if key == "step":
                raise ValueError("'step' is the record's key; pass it as write(step, ...), not in metrics")
            try:
                value = float(value)  # numpy / jax 0-d arrays too
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} must be a scalar number, got {type(value).__name__}") from None
            record[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._add_scalars(record)
        self._tb.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plot_metrics(
    jsonl_path: Path,
    png_path: Path,
    keys: Iterable[str | tuple[str, ...]] = ("reward_mean", "loss", "kl", "entropy"),
) -> list[str]:
    """One subplot per entry of `keys` that appears in the records, against step: a key, or a tuple
    of keys drawn together with a legend (e.g. a step's time split); written atomically. Returns the
    keys plotted (a figure saying "no metrics yet" when none appear)."""
    # The Agg canvas directly, not pyplot: no global backend switch, no GUI, safe in any thread.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(Path(jsonl_path))
    panels = [[k for k in ((entry,) if isinstance(entry, str) else entry) if any(k in r for r in records)]
              for entry in keys]
    panels = [p for p in panels if p]
    fig = Figure(figsize=(6.0, 2.2 * max(len(panels), 1)), dpi=100)
    FigureCanvasAgg(fig)
    if not panels:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center")
        ax.set_axis_off()
    for i, panel in enumerate(panels, 1):
        ax = fig.add_subplot(len(panels), 1, i)
        for key in panel:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None,
                    label=key)
        if len(panel) > 1:
            ax.legend(fontsize="small")
        else:
            ax.set_ylabel(panel[0])
        ax.grid(alpha=0.3)
        if i == len(panels):
            ax.set_xlabel("step")
    fig.tight_layout()
    png_path = Path(png_path)
    _replace_atomically(png_path, lambda tmp: fig.savefig(tmp, format="png"))
    return [k for panel in panels for k in panel]
