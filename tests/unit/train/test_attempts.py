"""The attempts ledger's accounting and MBR_FAULT's attempt/range fields."""

from __future__ import annotations

import pytest

from megatron_bridge import reliability
from megatron_bridge.train import attempts


def _a(n, started, first, last_step, last_at, saved, resumed_from=0, outcome=None, ended=None):
    return {
        "attempt": n,
        "started": started,
        "first_step_at": first,
        "last_step": last_step,
        "last_step_at": last_at,
        "saved": {str(k): v for k, v in saved.items()},
        "resumed_from": resumed_from,
        "outcome": outcome,
        "ended": ended,
    }


def test_fault_costs_recompute_and_restart():
    # attempt 0: started 0, first step at 10, saved step 3 at 13, died after step 5 at 15;
    # attempt 1 resumed from 3, its first step at 40, finished at 60.
    log = [
        _a(0, 0.0, 10.0, 5, 15.0, {3: 13.0}),
        _a(1, 20.0, 40.0, 14, 60.0, {}, resumed_from=3, outcome="finished", ended=60.0),
    ]
    (f,) = attempts.faults(log)
    assert (f.step, f.resumed_from, f.kind) == (5, 3, "fault")
    assert f.recompute_s == pytest.approx(2.0) and f.restart_s == pytest.approx(25.0)
    g, wall, lost = attempts.goodput(log)
    assert wall == pytest.approx(60.0) and lost == pytest.approx(27.0)
    assert g == pytest.approx((60 - 10 - 27) / 60)
    assert "1 fault(s)/stop(s) cost 27.0 s" in attempts.summary(log)


def test_fault_before_any_checkpoint_recomputes_everything():
    log = [_a(0, 0.0, 10.0, 4, 14.0, {}), _a(1, 20.0, 30.0, 8, 40.0, {}, outcome="finished", ended=40.0)]
    (f,) = attempts.faults(log)
    assert f.recompute_s == pytest.approx(4.0) and f.restart_s == pytest.approx(16.0)


def test_ledger_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    led = attempts.Ledger.open(str(tmp_path), tmp_path / "run", 0, enabled=True)
    led.first_step()
    led.step_done(3)
    led.saved(3)
    led.step_done(5)
    led.write()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    nxt = attempts.Ledger.open(str(tmp_path), tmp_path / "run", 3, enabled=True)
    assert [a["attempt"] for a in nxt.data["attempts"]] == [0, 1]
    assert attempts.read(tmp_path)["run_dir"] == str(tmp_path / "run")
    assert attempts.failed_steps(tmp_path) == [(0, 5)]
    nxt.first_step()
    (f,) = nxt.faults()
    assert f.resumed_from == 3 and f.step == 5


def test_fault_spec_attempt_and_ranges(monkeypatch):
    monkeypatch.setenv("MBR_FAULT", "kill:step:1:5:0,slow:step:0:3-9,stop:step:*:9:1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert reliability.planned("step", 5) == "kill"
    assert reliability.planned("step", 9) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert reliability.planned("step", 5) is None and reliability.planned("step", 9) == "stop"
    monkeypatch.setenv("RANK", "0")
    assert reliability.planned("step", 4) == "slow" and reliability.planned("step", 10) is None
    monkeypatch.setenv("MBR_FAULT", "kill:step:1:x")
    with pytest.raises(ValueError):
        reliability.planned("step", 1)
