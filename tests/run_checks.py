"""What a finished run directory must satisfy, shared by the resume and kill tests."""

from __future__ import annotations

import math
import struct
from pathlib import Path

from hybridmoe.run.metrics import read_metrics

TIMING_KEYS = {"tokens_per_s", "step_time_s", "rollout_time_s", "update_time_s", "old_logprobs_time_s",
               "rollout_tokens_per_s"}


def read_tensorboard(tb_dir: Path) -> dict[int, dict[str, float]]:
    """{step: {tag: value}} from every event file under tb_dir (TFRecord framing: u64 length,
    u32 crc, payload, u32 crc). A step written twice would appear as a duplicate tag: raise."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[int, dict[str, float]] = {}
    for path in sorted(Path(tb_dir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            payload = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            if len(payload) < length:
                break  # a torn last record
            event = Event.FromString(payload)
            for v in event.summary.value:
                tags = out.setdefault(int(event.step), {})
                if v.tag in tags:
                    raise AssertionError(f"{path}: step {event.step} tag {v.tag} written twice")
                tags[v.tag] = v.simple_value
    return out


def comparable(records: list[dict]) -> list[dict]:
    """Records without the wall-clock keys (which differ between any two runs)."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def assert_tensorboard_matches_jsonl(run_dir: Path) -> None:
    """Every finite value of metrics.jsonl is in TensorBoard at its step (float32), and nothing else."""
    records = read_metrics(run_dir / "metrics.jsonl")
    tb = read_tensorboard(run_dir / "tb")
    assert sorted(tb) == [r["step"] for r in records], (sorted(tb), [r["step"] for r in records])
    for r in records:
        want = {k: v for k, v in r.items() if k != "step" and v is not None}
        got = tb[r["step"]]
        assert set(got) == set(want), (r["step"], set(got) ^ set(want))
        for k, v in want.items():
            assert math.isclose(got[k], v, rel_tol=1e-6, abs_tol=1e-30) or (
                struct.unpack("f", struct.pack("f", v))[0] == got[k]), (r["step"], k, got[k], v)
