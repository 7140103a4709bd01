"""What every benchmark script shares: JAX's set-up, the command line, interleaved timing, the record.

A script calls `configure(...)` before it imports anything that starts JAX's backends (simulated
CPU devices, a compilation cache), builds its command line from `parser(...)` (which gives `--out`
its default, benchmarks/records/<script>.json), times its arms with `interleaved(...)` (every arm
compiled and warmed first by the caller, then rounds in a rotating order, so drift in the
machine's speed spreads over all arms) and ends with `write(...)`, which adds the machine, date,
commit and versions (tools/record.py) and writes the record atomically. Whole training steps are
timed by `hybridmoe.tools.bench.run_bench`, which interleaves the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "records"
ROOT = RECORDS.parent.parent


def configure(cpu_devices: int | None = None, *, cpu_only: bool = False, cache_dir: str | None = None,
              cache: bool = False) -> None:
    """JAX options that must be set before its backends start, and the commit the record will name
    (read now: a long run records the code it started from)."""
    import jax

    from hybridmoe.tools.record import source_commit

    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    if cpu_only:
        jax.config.update("jax_platforms", "cpu")
    if cache or cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir or tempfile.mkdtemp(prefix="hybridmoe-bench-"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    source_commit()


def parser(doc: str, script: str, *, raw: bool = False, record: str | None = None) -> argparse.ArgumentParser:
    """The script's command line with `--out` (default benchmarks/records/<record or the script's
    name>.json). `raw`: the whole docstring as the help text, as written."""
    p = argparse.ArgumentParser(description=doc if raw else doc.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter)
    p.add_argument("--out", default=str(RECORDS / f"{record or Path(script).stem}.json"),
                   help="write the JSON record here")
    return p


def one_device_config(doc: str, script: str, argv=None, default_recipe: str = "small"):
    """(args, recipe, overrides, config, rounds) of a benchmark of one layer on one device: `--steps`
    (timed rounds, default bench.steps) and the recipe and section.key=value words of the command
    line, the mesh pinned to one device (the layer's own arithmetic, no collectives in the timing)."""
    from hybridmoe.recipe import load_config, split_args

    p = parser(doc, script)
    p.add_argument("--steps", type=int, default=0, help="timed rounds (0 = bench.steps)")
    args, words = p.parse_known_args(argv)
    recipe, overrides = split_args(words or [f"recipe={default_recipe}"])
    overrides = ["mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=1", *overrides]
    cfg = load_config(recipe, overrides)
    return args, recipe, overrides, cfg, args.steps or cfg.bench.steps


def layer_case(cfg, kind: str, part: str):
    """One layer's weights, a random input [batch, seq_len, d_model] and two-document segment ids at
    the config's training shape: the first layer of `kind` ("gdn", "attention"), its `part`
    ("mixer", "moe"), unstacked from the scanned blocks."""
    import jax
    import jax.numpy as jnp

    from hybridmoe.model.params import declare_params, init_params

    m, t = cfg.model, cfg.train
    block = init_params(declare_params(m), jax.random.key(0))["blocks"][m.layer_pattern.index(kind)]
    params = jax.tree.map(lambda a: a[0], block[part])
    x = jax.random.normal(jax.random.key(1), (t.batch_size, t.seq_len, m.d_model)).astype(m.compute_dtype)
    # Two documents per row: the packed path, as training runs it.
    seg = jnp.where(jnp.arange(t.seq_len) < t.seq_len // 3, 1, 2)[None].repeat(t.batch_size, 0).astype(jnp.int32)
    return params, x, seg


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, reps: int = 1) -> dict[str, dict[str, list[float]]]:
    """Call every function `reps` times per round, the order rotated each round, blocking on each
    result: {name: {"wall_s": [...], "cpu_s": [...]}}, one mean per round (cpu_s: this process's CPU
    time, all threads)."""
    import jax

    times = {name: {"wall_s": [], "cpu_s": []} for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps):
                jax.block_until_ready(fns[name]())
            times[name]["wall_s"].append((time.perf_counter() - t0) / reps)
            times[name]["cpu_s"].append((time.process_time() - c0) / reps)
    return times


def package_versions(*packages: str) -> dict[str, str | None]:
    """Installed versions of further packages a record depends on (None where not installed)."""
    out = {}
    for pkg in packages:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def write(out: str | Path, benchmark: str, *, versions: dict | None = None, **fields) -> dict:
    """Write the record {benchmark, machine, date, commit, versions, backend, **fields} to `out`."""
    from hybridmoe.tools.record import machine_record, write_record

    record = {"benchmark": benchmark, **machine_record(), **fields}
    if versions:
        record["versions"] = {**record["versions"], **versions}
    write_record(Path(out), record)
    return record


def merged_with_earlier(out: str | Path, key: str, now: dict, device: str, commit: str) -> dict:
    """The entries `now` (each named with `commit`) over the `key` entries of an earlier record of the
    same device at `out` (none when there is no record or it is another device's): a rerun of some
    entries (the failed tests, one more arm) replaces theirs, the others keep their figures and the
    commit they were made at."""
    path = Path(out)
    old = json.loads(path.read_text()) if path.is_file() and path.stat().st_size else {}
    previous = old.get(key, {}) if old.get("device") == device else {}
    return {**previous, **{name: {**row, "commit": commit} for name, row in now.items()}}


# A child process run under `watched` marks each piece of work it starts and ends with these lines
# on its standard output (`mark(...)` prints them).
START_MARK, DONE_MARK = "@@start ", "@@done "


def mark(kind: str, name: str) -> None:
    print(f"{START_MARK if kind == 'start' else DONE_MARK}{name}", flush=True)


@dataclasses.dataclass
class Watched:
    """How a watched child ended: its exit status (None when it was stopped), the piece of work it
    was in when it was stopped or died (None when it ended between pieces), that piece's seconds,
    and the last line it printed in that piece (what it was doing)."""

    returncode: int | None
    cut: str | None = None
    seconds: float = 0.0
    last_line: str = ""

    def reason(self, share_s: float) -> str:
        doing = f" (its last line: {self.last_line[:200]!r})" if self.last_line else ""
        if self.returncode is None:
            return f"stopped after {self.seconds:.0f} s, past its {share_s:.0f} s share{doing}"
        return f"its process ended with status {self.returncode} after {self.seconds:.0f} s{doing}"


def watched(command: list[str], share_s: float, log: Callable[[str], None] = print) -> Watched:
    """Run `command`, echoing its output through `log`, and stop it when one piece of its work (from a
    START_MARK line to its DONE_MARK) runs past `share_s` seconds: a kernel or a step that hangs on a
    chip costs its share, never the call. The child is stopped with its whole process group (a
    compile it started goes too)."""
    import os
    import queue
    import signal
    import subprocess
    import threading

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()

    def read():
        for ln in proc.stdout:
            lines.put(ln)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    current, started, last = None, 0.0, ""
    while True:
        try:
            line = lines.get(timeout=0.5).rstrip("\n")
        except queue.Empty:
            line = None
        now = time.perf_counter()
        if line is None and not reader.is_alive():  # its output is over: it has ended
            proc.wait()
            if proc.returncode != 0 and current is not None:
                return Watched(proc.returncode, current, now - started, last)
            return Watched(proc.returncode)
        if line is not None and line.startswith(START_MARK):
            current, started, last = line[len(START_MARK):], now, ""
        elif line is not None and line.startswith(DONE_MARK):
            current = None
        elif line is not None:
            last = line or last
            log(line)
        if current is not None and now - started > share_s:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Watched(None, current, now - started, last)
