"""Non-finite numbers and preemption signals (docs/train.md "Non-finite steps", "Preemption"):
the policy of `train.on_nonfinite`, the weight check before a checkpoint, the signal flag, the
value rule (config.json: tests/unit/bridge/test_hf_config_finite.py; token ids:
tests/unit/data/test_token_ids.py; convert: tests/unit/convert/test_finite.py). The
training runs themselves are tests/reliability/test_signals_numerics.py (one process) and the
crash suite (torchrun)."""

from __future__ import annotations

import math
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from megatron_bridge.config.compose import compose
from megatron_bridge.config.schema import Config
from megatron_bridge.parallel.rules.values import finite_values
from megatron_bridge.train.guard import EXIT_NONFINITE, NonFinite, NonFiniteSteps, StopSignals, check_finite_weights


def _cfg(policy: str, limit: int = 3):
    return SimpleNamespace(train=SimpleNamespace(on_nonfinite=policy, max_skipped_steps=limit))


def test_stop_ends_at_the_first_non_finite_step_naming_it():
    g = NonFiniteSteps(_cfg("stop"))
    g.after(1, 2.0, 1.0, True, 0)
    with pytest.raises(NonFinite, match="step 2 has a non-finite loss") as e:
        g.after(2, math.nan, math.nan, False, 0)
    assert e.value.exit_code == EXIT_NONFINITE == 3


def test_skip_counts_and_stops_after_max_skipped_steps_in_a_row(capsys):
    g = NonFiniteSteps(_cfg("skip", 2))
    g.after(1, math.nan, math.nan, False, 0)
    g.after(2, 1.0, 1.0, True, 0)  # a good step resets the run of skips
    g.after(3, math.inf, 1.0, False, 0)
    assert "skipped (1 in a row, 2 in all)" in capsys.readouterr().out
    with pytest.raises(NonFinite, match="2 non-finite steps in a row"):
        g.after(4, math.nan, math.nan, False, 0)


@pytest.fixture
def group(tmp_path):
    """A one-process gloo group (the collectives of the guard)."""
    if torch.distributed.is_initialized():
        yield
        return
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_weights_with_nan_are_not_checkpointed(group):
    m = torch.nn.Linear(4, 4)
    check_finite_weights([m], 3, "cpu")
    with torch.no_grad():
        m.weight[1, 2] = math.inf
    with pytest.raises(NonFinite, match="the weights after step 3 are not finite"):
        check_finite_weights([m], 3, "cpu")


def test_sigterm_and_sigusr1_are_noted_and_agreed_on(group):
    s = StopSignals("cpu")
    try:
        assert s.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert s.requested() == "SIGUSR1"
    finally:
        s.close()
    assert signal.getsignal(signal.SIGUSR1) != s._note  # the previous handler is back


def test_non_finite_settings_are_a_rule():
    cfg, _ = compose(["optimizer.lr=inf", "model.norm_epsilon=nan", "train.max_skipped_steps=0"], schema=Config)
    got = {v.rule: v.detail for v in finite_values(SimpleNamespace(run=cfg))}  # type: ignore[arg-type]
    assert set(got) == {"finite-value", "max-skipped-steps"}
    assert "model.norm_epsilon=nan, optimizer.lr=inf" in got["finite-value"]


def test_a_preempted_rank_outlives_a_dead_launcher_while_it_saves(monkeypatch):
    """SIGTERM noted -> orphans.defer: a launcher gone meanwhile ends the rank only after the
    grace period (the single-node `deepspeed` runner dies of SIGTERM; Slurm signals it too)."""
    from megatron_bridge.train import orphans

    exits = []
    monkeypatch.setattr(orphans, "_gone", lambda: ("deepspeed", 12345, False))
    monkeypatch.setattr(orphans.os, "_exit", exits.append)
    monkeypatch.setattr(orphans, "_grace_until", 0.0)
    orphans.defer(60)
    orphans._exit_if_orphaned()
    assert exits == []
    monkeypatch.setattr(orphans, "_grace_until", 0.0)
    orphans._exit_if_orphaned()
    assert exits == [orphans.EXIT]


def test_a_dead_runner_above_a_live_parent_stops_the_run_like_sigterm(group, monkeypatch, capsys):
    """The `deepspeed` runner gone while launch.py lives (it dies of SIGTERM without forwarding
    it): a run with a checkpoint directory stops at the next step boundary instead of ending as
    an orphan, and gets STOP_S to reach it; without one (no hook) the rank ends at once."""
    from megatron_bridge.train import orphans

    exits: list[int] = []
    monkeypatch.setattr(orphans, "_gone", lambda: ("deepspeed", 12345, True))
    monkeypatch.setattr(orphans.os, "_exit", exits.append)
    monkeypatch.setattr(orphans, "_grace_until", 0.0)
    s = StopSignals("cpu", save_on_launcher_gone=True)
    try:
        assert s.requested() is None
        orphans._exit_if_orphaned()  # the watch thread's tick
        assert exits == [] and orphans._grace_until > orphans.time.monotonic() + orphans.STOP_S - 1
        assert (
            "launcher deepspeed (pid 12345) is gone while this rank's own launcher lives on" in capsys.readouterr().err
        )
        assert s.requested() == "launcher gone"
        assert orphans._grace_until > orphans.time.monotonic() + 100  # the save's own grace
        orphans._exit_if_orphaned()  # later ticks: the hook ran once; the grace holds the exit back
        assert exits == []
        monkeypatch.setattr(orphans, "_grace_until", 0.0)
        orphans._exit_if_orphaned()  # a rank that never reached its boundary (hung) still ends
        assert exits == [orphans.EXIT]
    finally:
        s.close()
    plain = StopSignals("cpu")  # no checkpoint.dir: nothing to save, the orphan ends at once
    try:
        orphans._exit_if_orphaned()
        assert exits == [orphans.EXIT, orphans.EXIT] and plain.requested() is None
    finally:
        plain.close()
