"""The `logger` group (config/schema.py LoggerConfig, docs/train.md "Loggers"): each sink on or
off and named from the recipe, MLflow to a file store, metrics.jsonl always; the rule that
refuses an MLflow recipe where mlflow is not installed, and unknown keys refused as in every group."""

import json
import time

import pytest

from megatron_bridge.config.compose import compose
from megatron_bridge.config.schema import (
    LoggerConfig,
    MlflowLoggerConfig,
    TensorBoardLoggerConfig,
    WandbLoggerConfig,
)
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.rules import run as run_rules
from megatron_bridge.train.metrics import MetricsLogger

OFF = dict(wandb=WandbLoggerConfig(enabled=False), tensorboard=TensorBoardLoggerConfig(enabled=False))


def _log(run_dir, lg, steps=2):
    m = MetricsLogger(run_dir, steps, enabled=True, loggers=lg, config={"layout": "tp1", "recipe": {"a": {"b": 1}}})
    for s in range(1, steps + 1):
        m.log(s, {"loss": 10.0 / s, "lr": 1e-3})
    m.close()
    return m


def test_all_off_writes_only_metrics_jsonl(tmp_path):
    _log(tmp_path, LoggerConfig(**OFF))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # neither tensorboard/ nor wandb/
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [10.0, 5.0]


def test_tensorboard_dir(tmp_path):
    _log(
        tmp_path / "run",
        LoggerConfig(wandb=OFF["wandb"], tensorboard=TensorBoardLoggerConfig(dir=str(tmp_path / "tb"))),
    )
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_a_failing_sink_is_turned_off_and_training_logs_on(tmp_path, capsys):
    """wandb's service process dies of the SIGTERM a scheduler sends every process of the job:
    its log call raises; the sink goes off with one warning, metrics.jsonl keeps every step."""
    m = MetricsLogger(tmp_path, 3, enabled=True, loggers=LoggerConfig(wandb=OFF["wandb"]))
    calls = []

    class Dead:
        def log(self, metrics, step):
            calls.append(step)
            raise ConnectionResetError("Connection lost")

        def finish(self):
            raise AssertionError("a turned-off sink is not called again")

    m.wandb = Dead()
    for s in (1, 2, 3):
        m.log(s, {"loss": float(s)})
    m.close()
    assert calls == [1] and m.wandb is None
    err = capsys.readouterr().err
    assert err.count("warning: wandb failed at step 1 (ConnectionResetError: Connection lost)") == 1, err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_wandb_offline_run_has_project_and_name(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    w = WandbLoggerConfig(project="proj-x", name="run-y", group="grp", tags=["t1", "t2"])
    _log(tmp_path, LoggerConfig(wandb=w, tensorboard=OFF["tensorboard"]))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    for _ in range(50):  # wandb's service may still be flushing the run record after finish()
        blob = b"".join(p.read_bytes() for p in runs[0].rglob("*") if p.is_file())
        if all(s in blob for s in (b"proj-x", b"run-y", b"grp", b"t1")):
            break
        time.sleep(0.1)
    for s in (b"proj-x", b"run-y", b"grp", b"t1"):
        assert s in blob, s


def test_wandb_disabled_by_environment_never_imports(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    m = _log(tmp_path, LoggerConfig(tensorboard=OFF["tensorboard"]))
    assert m.wandb is None and "wandb" not in sys.modules and not (tmp_path / "wandb").exists()


def test_mlflow_file_store_records_loss(tmp_path):
    pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    lg = LoggerConfig(**OFF, mlflow=MlflowLoggerConfig(enabled=True, tracking_uri=f"file:{store}", run_name="r1"))
    _log(tmp_path / "run", lg)
    loss = list(store.rglob("metrics/loss"))
    assert len(loss) == 1
    values = [float(line.split()[1]) for line in loss[0].read_text().splitlines()]
    assert values == [10.0, 5.0]
    assert any(p.read_text().strip() == "r1" for p in store.rglob("tags/mlflow.runName"))


def _violations(*overrides):
    cfg, _ = compose(["recipe=tiny_llama", *overrides])
    (rule,) = [r for r in run_rules.RULES if r.name == "loggers"]
    return {v.rule for v in rule(None, None, cfg)}


def test_rules(monkeypatch):
    import importlib.util

    assert _violations() == set()
    assert _violations("logger.wandb.mode=offlne") == {"logger-wandb-mode"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    assert _violations("logger.mlflow.enabled=true") == {"logger-mlflow"}
    assert _violations() == set()


def test_unknown_logger_key_refused():
    with pytest.raises(UserError, match="projct"):
        compose(["recipe=tiny_llama", "logger.wandb.projct=x"])
