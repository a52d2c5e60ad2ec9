"""Straggler detection under a real 2-rank torchrun launch, both engines in one launch
(tests/reliability/scripts/jobs.py): one rank is slowed (`MBR_FAULT=slow`, 0.5 s inside its
forward-backward) in steps 1-4 of 6, `train.straggler_interval=2`. The slowed rank must be
named, with its host, in each of the first two intervals, and `slowest_rank` /
`slowest_rank_ratio` logged at every interval; in the last interval (nobody slowed) no rank is
named. The sleeps change no number: the losses equal a run without the fault.
"""

from __future__ import annotations

import json
import re
import socket

import pytest

try:  # pytest's default (prepend) import mode puts this directory on sys.path
    from harness import launch
except ImportError:  # pragma: no cover
    from tests.reliability.harness import launch

pytestmark = pytest.mark.dist

COMMON = [
    "recipe=default",
    "train.steps=6",
    "train.seq_length=32",
    "train.global_batch_size=4",
    "optimizer.warmup_steps=1",
    "data=synthetic",
    "train.straggler_interval=2",
    "train.straggler_factor=3",
]
JOBS = {  # name: (slowed rank, engine overrides)
    "megatron": (1, []),
    "deepspeed": (0, ["train.engine=deepspeed", "zero.stage=1"]),
}


def _job(name: str, fault: str, extra: list[str]) -> str:
    return f"{name}|{fault}|" + ",".join([*COMMON, *extra])


def test_a_slowed_rank_is_named_within_two_intervals(tmp_path, monkeypatch):
    monkeypatch.setenv("MBR_FAULT_SLOW_S", "0.5")
    jobs = []
    for name, (slow, extra) in JOBS.items():
        jobs += [_job(name, f"slow:step:{slow}:1-4", extra), _job(f"{name}_ref", "", extra)]
    run = launch(jobs, 2, tmp_path / "out", timeout=300)
    assert run.rc == 0, run.output[-5000:]
    host = socket.gethostname()
    lines = re.findall(r"^straggler: .*$", run.output, flags=re.M)
    for name, (slow, _) in JOBS.items():
        assert run.results[name] == run.results[f"{name}_ref"], name  # the sleeps change no number
        rows = [json.loads(line) for line in (tmp_path / "out/runs" / name / "metrics.jsonl").read_text().splitlines()]
        at = {r["step"]: r for r in rows if "slowest_rank" in r}
        assert sorted(at) == [2, 4, 6], name
        for step in (2, 4):
            assert at[step]["slowest_rank"] == slow and at[step]["slowest_rank_ratio"] > 3, (name, at[step])
            want = f"straggler: rank {slow} on {host} computed "
            assert any(ln.startswith(want) and f"over steps {step - 1}-{step}," in ln for ln in lines), (name, lines)
        assert at[6]["slowest_rank_ratio"] < 3, (name, at[6])
    print("\n".join(lines))
    assert len(lines) == 4, lines  # two per slowed job, none for the last intervals or the references
