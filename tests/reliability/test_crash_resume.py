"""Crash and resume, no hangs: real torchrun launches of 4 CPU processes, killed on purpose.

Each scenario injects one fault (`MBR_FAULT`, megatron_bridge/reliability.py) into a training
run that checkpoints every 2 of its 8 steps: a rank SIGKILLed mid-step or mid-checkpoint-write,
the whole job SIGKILLed mid-step (by this harness, torchrun agent included) or mid-checkpoint-
write (every rank), the torchrun agent alone SIGKILLed mid-step (its ranks must end themselves
within ORPHAN_BOUND s: train/orphans.py), a rank raising an exception, a rank hanging. For each
one we check that

  * the whole job ends (exit != 0) within its bound, no worker process survives it, and the
    output names the failing rank and the reason;
  * the checkpoint directory's `latest` names the last *complete* checkpoint (never a torn
    one), which `mbr check-ckpt` verifies;
  * `checkpoint.resume=true` picks it up and reproduces the uninterrupted run's losses bit for
    bit (fp32 on CPU, fixed seeds), and the crashed run's own losses up to the crash equal them.

Launches are chained to save startup time (imports dominate: ~4×8 s CPU per launch): launch k
runs the resume of scenario k-1, then scenario k, which crashes it; the first launch also
trains the uninterrupted references (one per layout). The figures are printed in pytest's
terminal summary and recorded in docs/reliability.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from megatron_bridge.train import manifest

try:  # pytest's default (prepend) import mode puts this directory on sys.path
    from harness import Launch, launch, losses, torchrun_failures
except ImportError:  # pragma: no cover
    from tests.reliability.harness import Launch, launch, losses, torchrun_failures

pytestmark = pytest.mark.dist

NPROC = 4
STEPS = 8
ORPHAN_BOUND = 15.0  # seconds a rank may outlive its SIGKILLed launcher
HANG_TIMEOUT_MIN = 0.15  # train.timeout_minutes of the hang scenario: the watchdog ends it after 9 s
COMMON = [
    "recipe=default",
    f"train.steps={STEPS}",
    "train.seq_length=32",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "optimizer.warmup_steps=2",
    "optimizer.lr=3e-3",
    "data=synthetic",
    "checkpoint.save_interval=2",
]
LAYOUTS = {
    "tp2pp2": ["parallel.tp=2", "parallel.pp=2"],
    "pp2dp2z1": ["parallel.pp=2", "zero.stage=1"],  # DistributedOptimizer: optimizer state sharded over dp
}


@dataclass
class Scenario:
    name: str
    layout: str
    fault: str  # MBR_FAULT
    what: str  # the crash point, in words
    latest: int  # the iteration `latest` must name afterwards
    torn: int | None = None  # an iter_N.tmp the crash must leave behind (ignored on resume)
    names: tuple[str, ...] = ()  # what the output must say (the failing rank and the reason)
    exits: dict[int, int] = field(default_factory=dict)  # rank -> exit code in torchrun's failure report
    bound: float = 30.0  # the whole job must have exited this many seconds after the fault fired
    # The harness kills the whole launch once N ranks sit in their `hang` fault (the first pipeline
    # stage's: the others are then blocked mid-step waiting on them).
    kill_when: int | None = None
    agent_only: bool = False  # kill_when kills the torchrun agent alone, not its ranks
    extra: tuple[str, ...] = ()
    ci: bool = True  # False: run only with MBR_TEST_ALL=1 (its mechanism is another scenario's; CI time)


ALL_SCENARIOS: list[Scenario] = [
    Scenario(
        "rank_sigkill_mid_step",
        "tp2pp2",
        "kill:step:1:5",
        "rank 1 of 4 SIGKILLed mid-step 5",
        4,
        exits={1: -9},
        names=("Signal 9 (SIGKILL) received by PID",),
    ),
    Scenario(
        "rank_sigkill_mid_async_ckpt_write",
        "pp2dp2z1",
        "kill:ckpt_write:2:4",
        "rank 2 of 4 SIGKILLed in its background checkpoint write (async_save, step 4: file written, not published)",
        2,
        torn=4,
        exits={2: -9},
        extra=("checkpoint.async_save=true",),  # the other ranks train on into step 5 meanwhile
    ),
    Scenario(
        "job_sigkill_mid_step",
        "tp2pp2",
        "hang:step:*:7",
        "whole job SIGKILLed mid-step 7 (torchrun agent and all 4 ranks, from outside)",
        6,
        kill_when=2,
        ci=False,  # agent_sigkill_mid_step kills from outside too; rank_sigkill_mid_step resumes after a kill
    ),
    Scenario(
        "agent_sigkill_mid_step",
        "pp2dp2z1",
        "hang:step:*:5",
        "torchrun agent alone SIGKILLed mid-step 5 (its 4 ranks left running: 2 blocked in a collective)",
        4,
        kill_when=2,
        agent_only=True,
        names=("launcher torchrun (pid", "is gone; exiting so no orphaned rank keeps training"),
    ),
    Scenario(
        "job_sigkill_mid_ckpt_write",
        "pp2dp2z1",
        "kill:ckpt_write:*:6",
        "all 4 ranks SIGKILLed mid-checkpoint-write (step 6)",
        4,
        torn=6,
        names=("Signal 9 (SIGKILL)",),
    ),
    Scenario(
        "rank_raises",
        "tp2pp2",
        "raise:step:2:3",
        "rank 2 of 4 raises an exception mid-step 3",
        2,
        exits={2: 1},
        names=("rank 2 failed in step 3: RuntimeError: injected fault raise:step:2:3",),
    ),
    Scenario(
        "rank_hangs",
        "pp2dp2z1",
        "hang:step:1:5",
        "rank 1 of 4 hangs mid-step 5 (outside any collective)",
        4,
        names=(
            "rank 1 failed in step 5: no progress for 9 s (train.timeout_minutes=0.15)",
            "outside any communication call: this rank itself is stuck",
        ),
        exits={1: 1},
        bound=HANG_TIMEOUT_MIN * 60 + 25,
        extra=(f"train.timeout_minutes={HANG_TIMEOUT_MIN}",),
    ),
]


SCENARIOS = [s for s in ALL_SCENARIOS if s.ci or os.environ.get("MBR_TEST_ALL") == "1"]

# Preemption under torchrun, riding in the chain's launches (no launch of their own): SIGTERM to
# rank 1 alone mid-step 5 in launch 0 (every rank must agree to save step 5), resumed in launch 1;
# SIGTERM to the torchrun agent while all ranks are mid-step 5, in the last launch (the agent
# forwards it: the ranks finish the step, save it and exit 0 within its 30 s grace period).
SIGTERM_RANK = ("sigterm_rank1", "tp2pp2", "term:step:1:5")
SIGTERM_AGENT = ("sigterm_agent", "pp2dp2z1", "pause:step:*:5")


def _job(name: str, layout: str, fault: str = "", *overrides: str) -> str:
    return f"{name}|{fault}|" + ",".join([*COMMON, *LAYOUTS[layout], *overrides])


@dataclass
class Record:
    scenario: Scenario
    crash: Launch | None = None
    latest: int | None = None
    tmp_dirs: list[str] = field(default_factory=list)
    check_ckpt_rc: int | None = None
    crashed_losses: dict[str, float] = field(default_factory=dict)
    resumed: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, request):
    """Run every scenario: 1 + len(SCENARIOS) launches. Returns (references, records, launches)."""
    from megatron_bridge.cli import main as mbr

    root = tmp_path_factory.mktemp("crash")
    records = [Record(s) for s in SCENARIOS]
    launches: list[tuple[str, Launch]] = []
    refs: dict[str, dict[str, float]] = {}
    for k in range(len(SCENARIOS) + 1):
        jobs = []
        if k == 0:
            jobs += [_job(f"ref_{name}", name) for name in LAYOUTS]
            jobs.append(_job(*SIGTERM_RANK, f"checkpoint.dir={root / SIGTERM_RANK[0]}"))
        else:
            if k == 1:
                jobs.append(
                    _job(
                        f"resume_{SIGTERM_RANK[0]}",
                        SIGTERM_RANK[1],
                        "",
                        f"checkpoint.dir={root / SIGTERM_RANK[0]}",
                        "checkpoint.resume=true",
                    )
                )
            prev = SCENARIOS[k - 1]
            jobs.append(
                _job(
                    f"resume_{prev.name}",
                    prev.layout,
                    "",
                    f"checkpoint.dir={root / prev.name}",
                    "checkpoint.resume=true",
                )
            )
        if k < len(SCENARIOS):
            s = SCENARIOS[k]
            jobs.append(_job(s.name, s.layout, s.fault, f"checkpoint.dir={root / s.name}", *s.extra))
        else:
            jobs.append(_job(*SIGTERM_AGENT, f"checkpoint.dir={root / SIGTERM_AGENT[0]}"))
        out = root / f"launch{k}"
        s = SCENARIOS[k] if k < len(SCENARIOS) else None
        run = launch(
            jobs,
            NPROC,
            out,
            timeout=240,
            kill_when=s and s.kill_when,
            agent_only=bool(s and s.agent_only),
            term_agent_when=2 if s is None else None,  # the first pipeline stage draws the data
        )
        launches.append((f"launch {k}", run))
        if k == 0:
            refs = {name: run.results.get(f"ref_{name}", {}) for name in LAYOUTS}
        else:
            records[k - 1].resumed = run.results.get(f"resume_{SCENARIOS[k - 1].name}", {})
        if k < len(SCENARIOS):
            rec, s = records[k], SCENARIOS[k]
            rec.crash = run
            d = root / s.name
            rec.latest = manifest.latest_iteration(d)
            rec.tmp_dirs = sorted(p.name for p in d.glob("iter_*.tmp")) if d.exists() else []
            rec.check_ckpt_rc = mbr(["check-ckpt", str(d)]) if rec.latest is not None else None
            rec.crashed_losses = losses(out / "runs" / s.name)
    agent = root / SIGTERM_AGENT[0]
    request.config._mbr_sigterm = {
        "rank_latest_after_resume": manifest.latest_iteration(root / SIGTERM_RANK[0]),
        "agent_latest": manifest.latest_iteration(agent),
        "agent_check_ckpt_rc": mbr(["check-ckpt", str(agent)]) if agent.exists() else None,
        "agent_losses": losses(root / f"launch{len(SCENARIOS)}" / "runs" / SIGTERM_AGENT[0]),
    }
    request.config._mbr_crash = (refs, records, launches)
    return refs, records, launches


def test_sigterm_to_one_rank_saves_the_step_every_rank_agrees_on_and_resumes_exactly(chain, request):
    refs, _, launches = chain
    name, layout, _ = SIGTERM_RANK
    first, second = launches[0][1], launches[1][1]
    ref = refs[layout]
    assert first.output.count("SIGTERM: stopping after step 5: saved checkpoint") == 1, first.output[-4000:]
    assert first.results[name] == {k: ref[k] for k in ("1", "2", "3", "4", "5")}  # the step under way finished
    assert f"{name}/iter_0000005 (step 5)" in second.output, second.output[-4000:]  # the signal's checkpoint
    assert second.results[f"resume_{name}"] == {k: ref[k] for k in ("6", "7", "8")}  # bit for bit


def test_sigterm_to_the_torchrun_agent_saves_and_the_ranks_exit_0(chain, request):
    refs, _, launches = chain
    run, got = launches[-1][1], request.config._mbr_sigterm
    tail = run.output[-6000:]
    assert len(run.faults) >= 2 and not run.survivors, tail  # the last stage pauses too, later in step 5
    assert run.output.count("SIGTERM: stopping after step 5: saved checkpoint") == 1, tail
    assert got["agent_latest"] == 5 and got["agent_check_ckpt_rc"] == 0, (got, tail)
    assert got["agent_losses"] == {k: refs[SIGTERM_AGENT[1]][k] for k in ("1", "2", "3", "4", "5")}
    # torchrun's agent itself re-raises the SignalException once its ranks have exited (0 each)
    assert torchrun_failures(run.output) == {} and "SignalException" in run.output, tail


def test_references_trained(chain):
    refs, _, launches = chain
    for name, losses_ in refs.items():
        assert sorted(map(int, losses_)) == list(range(1, STEPS + 1)), (name, launches[0][1].output[-5000:])


@pytest.mark.parametrize("idx", range(len(SCENARIOS)), ids=[s.name for s in SCENARIOS])
def test_job_ends_and_names_the_failing_rank(chain, idx):
    _, records, _ = chain
    rec = records[idx]
    s, run = rec.scenario, rec.crash
    tail = run.output[-6000:]
    assert run.rc != 0, tail
    assert not run.survivors, f"worker processes survived the job: {run.survivors}"
    if s.kill_when:
        assert run.killed and len(run.faults) >= s.kill_when, tail
    if s.agent_only:  # every rank noticed its launcher's death and ended itself
        assert run.orphans_gone is not None and run.orphans_gone <= ORPHAN_BOUND, (run.orphans_gone, tail)
        assert run.output.count(s.names[1]) == NPROC, tail
    if s.kill_when:
        return
    assert run.faults, f"the fault {s.fault} never fired\n{tail}"
    assert run.exit_after_fault is not None and run.exit_after_fault <= s.bound, (run.exit_after_fault, tail)
    for needle in s.names:
        assert needle in run.output, (needle, tail)
    reported = torchrun_failures(run.output)
    for rank, code in s.exits.items():
        assert reported.get(rank) == code, (rank, code, reported, tail)


@pytest.mark.parametrize("idx", range(len(SCENARIOS)), ids=[s.name for s in SCENARIOS])
def test_latest_is_the_last_complete_checkpoint(chain, idx):
    _, records, _ = chain
    rec = records[idx]
    s = rec.scenario
    assert rec.latest == s.latest, (rec.latest, rec.crash.output[-4000:])
    assert rec.check_ckpt_rc == 0  # `mbr check-ckpt` verifies every file of it
    if s.torn is not None:
        assert rec.tmp_dirs == [f"iter_{s.torn:07d}.tmp"], rec.tmp_dirs  # the torn save, never published


@pytest.mark.parametrize("idx", range(len(SCENARIOS)), ids=[s.name for s in SCENARIOS])
def test_resume_reproduces_the_uninterrupted_run(chain, idx):
    refs, records, launches = chain
    rec = records[idx]
    s = rec.scenario
    ref = refs[s.layout]
    # the crashed run, up to its crash, is the uninterrupted run
    assert rec.crashed_losses and all(rec.crashed_losses[k] == ref[k] for k in rec.crashed_losses)
    # the resumed run starts right after `latest` and equals the uninterrupted run bit for bit
    assert sorted(map(int, rec.resumed)) == list(range(s.latest + 1, STEPS + 1)), (
        rec.resumed,
        launches[idx + 1][1].output[-4000:],
    )
    for step, loss in rec.resumed.items():
        assert loss == ref[step], (step, ref[step], loss)


def test_a_killed_jobs_lease_is_taken_over(chain):
    """The lease on the checkpoint directory (train/lease.py) left by a job killed -9 does not
    block its resume: the holder's pid is gone, so the resume takes the lease over."""
    _, records, launches = chain
    for idx, rec in enumerate(records):
        if rec.scenario.kill_when:
            out = launches[idx + 1][1].output
            assert "taking over the lease on checkpoint.dir=" in out and "is gone" in out, out[-4000:]


def figures(refs, records, launches) -> str:
    """The table printed in the terminal summary (and copied into docs/reliability.md)."""
    lines = [f"{'scenario':30s} {'crash point':78s} {'job ended':>10s} {'latest':>6s} {'resumed':>8s}  exact"]
    for r in records:
        s, run = r.scenario, r.crash
        if run is None:
            continue
        ended = "killed" if run.killed else (f"{run.exit_after_fault:.1f} s" if run.exit_after_fault else "?")
        if run.orphans_gone is not None:
            ended = f"ranks {run.orphans_gone:.1f} s"
        exact = bool(r.resumed) and all(r.resumed[k] == refs[s.layout].get(k) for k in r.resumed)
        first = min(map(int, r.resumed)) - 1 if r.resumed else None
        lines.append(
            f"{s.name:30s} {s.what[:78]:78s} {ended:>10s} {str(r.latest):>6s} "
            f"{'from ' + str(first) if first is not None else '-':>8s}  {'yes' if exact else 'NO'}"
        )
    lines.append("launch wall times: " + ", ".join(f"{n} {lw.wall:.0f} s" for n, lw in launches))
    return "\n".join(lines)
