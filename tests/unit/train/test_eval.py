"""Validation's bookkeeping: when an evaluation runs and where `val_loss` is written.
(tests/dist/test_train.py runs it for real: equal across layouts and engines, training
unchanged bit for bit; tests/unit/parallel/test_rules.py holds its config rules.)"""

import json
from types import SimpleNamespace

import pytest

from megatron_bridge.config.schema import LoggerConfig, WandbLoggerConfig
from megatron_bridge.train.job import _eval_due
from megatron_bridge.train.metrics import MetricsLogger


def cfg(interval, iters):
    return SimpleNamespace(train=SimpleNamespace(eval_interval=interval, eval_iters=iters))


@pytest.mark.parametrize(
    "interval,iters,stop,expected",
    [
        (2, 3, 5, [2, 4, 5]),  # every 2 steps and at the end
        (5, 3, 10, [5, 10]),  # the end coincides with the interval: once
        (0, 3, 5, [5]),  # eval_interval=0: the end only (megatron-LM's convention)
        (2, 0, 5, []),  # eval_iters=0: off
        (0, 0, 5, []),
    ],
)
def test_evaluation_steps(interval, iters, stop, expected):
    assert [s for s in range(1, stop + 1) if _eval_due(cfg(interval, iters), s, last=s == stop)] == expected


def test_a_launch_that_stops_early_evaluates_at_its_last_step():
    """train.exit_after: the last step of this launch, like the checkpoint saved there."""
    assert _eval_due(cfg(0, 1), 3, last=True) and not _eval_due(cfg(0, 1), 3, last=False)


def test_val_loss_rides_in_the_step_row_and_goes_to_valid_loss_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, 4, enabled=True, loggers=LoggerConfig(wandb=WandbLoggerConfig(enabled=False)))
    log.log(1, {"loss": 2.5})
    log.log(2, {"loss": 2.0, "val_loss": 2.25})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("val_loss")) for r in rows] == [(1, None), (2, 2.25)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "valid/loss"}
    assert [(e.step, e.value) for e in events.Scalars("valid/loss")] == [(2, 2.25)]
