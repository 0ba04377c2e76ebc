"""The fault matrix: every launch layout x every fault x every resume setting, with real processes.

Each cell runs the tests' tiny LM on 2 ranks (fully_sharded, 10 steps, a checkpoint every 3) with one fault at step 7
(a save that fails: at step 6), as the layout runs it: shardlab's own local ranks, torchrun, a Slurm job with one task
per rank, a one-task Slurm job that starts its ranks, and a Slurm job of one task per rank on two hosts (the test
cluster's partition multi; there also the loss of rank 1's whole node). The job is then requeued (Slurm does it, or
the test reruns the same command, as a supervisor or the user would), and the cell checks what a user must be able to
rely on:

- the first attempt ends as it should and says so (exit code, status.json, the submitter's report);
- no rank hangs: it ends within the collective timeout of the fault;
- no step before the last completed save is lost, and the run never goes backwards: the requeue resumes exactly at
  the folder's newest checkpoint (never at the resume path or the init_from weights it began from);
- the final losses equal the uninterrupted run's, step by step (TensorBoard's float32 scalars, rtol 1e-5).

The cells CI runs are DEFAULT_CELLS (about a minute and a half on 2 cores, in its ``-m e2e`` pass, as the whole file
is end-to-end); the rest run with ``-m slow``.
``SHARDLAB_FAULT_MATRIX_OUT=<json>`` collects each cell's outcome (tests/faults/conftest.py) for
shardlab_bench/fault_matrix.py to render as docs/fault-matrix.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.distributed.env import free_port
from shardlab.jobs import run_record
from shardlab.runner import run_rank
from shardlab_bench.fault_matrix import applies
from tests.conftest import TINY_LM
from tests.events import scalars
from tests.faults.conftest import record_cell
from tests.slurm.conftest import cluster
from tests.slurm.test_multinode import node_state, start_once_pending
from tests.slurm.test_slurm import start_requeued_job_now

pytestmark = pytest.mark.e2e  # jobs requeued as each layout does: CI runs it after the suite (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests" / "faults" / "site"
TIMEOUT_S = 30
FAULT_STEP, SAVE_FAULT_STEP, MAX_STEPS = 7, 6, 10
RUN = [
    *TINY_LM,
    f"optimization.max_steps={MAX_STEPS}",
    "checkpoint.interval_steps=3",
    "checkpoint.keep_last=5",
    "validation.interval_steps=0",
    "logging.tensorboard=true",
]
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
TWO_RANKS = ["distributed.backend=fully_sharded", f"distributed.timeout_s={TIMEOUT_S}"]

LAYOUTS = ("local", "torchrun", "slurm_tasks", "slurm_local", "slurm_2nodes")
EVENTS = (
    "kill_one", "kill_all", "usr2", "sigterm", "scontrol_requeue", "kill_node", "error_one_rank", "save_fails_rank0",
)  # fmt: skip
RESUMES = ("auto", "path", "none", "init_from")
DEFAULT_CELLS = {
    ("torchrun", "sigterm", "init_from"),
    ("slurm_local", "usr2", "auto"),
}
"""The layouts the other default tests do not fault: torchrun, and a one-task Slurm job that starts its ranks (USR2,
resumed by auto; by an explicit path with -m slow, as tests/unit/test_requeue.py resumes by path by default).
Elsewhere in CI: Slurm's one task per rank (tests/slurm/test_slurm.py: USR2, scontrol requeue, cancellation,
SIGKILL), local ranks (tests/distributed/test_preemption.py: a signal on one rank, Ctrl-C; errors and requeues with
every resume setting in tests/unit/test_requeue.py), SIGKILL (test_kill_loop.py), a failing save and a failing
set-aside (tests/distributed/test_checkpoint_agreement.py). All 104 cells: -m "slow or not slow"."""
SLURM_REQUEUES = ("usr2", "scontrol_requeue")
"""Events after which Slurm requeues the job itself (through submitit, or as scontrol asks); after the others the job
ends and the test resubmits the same command."""
LOST_HOST = ("kill_one", "kill_node")
"""On 2 nodes, events that leave rank 0 a lost host (rank 1's processes gone without an error of their own): rank 0
names it and requeues the job (distributed.on_lost_host=requeue), which resumes from the newest complete checkpoint."""
MULTI = ["hydra.launcher.partition=multi", "hydra.launcher.nodes=2"]


def cells():
    for layout in LAYOUTS:
        for event in EVENTS:
            if not applies(layout, event):
                continue  # no scheduler to requeue, or no second node to lose
            for resume in RESUMES:
                marks = [pytest.mark.slurm] if layout.startswith("slurm") else []
                if (layout, event, resume) not in DEFAULT_CELLS:
                    marks.append(pytest.mark.slow)
                yield pytest.param(layout, event, resume, marks=marks, id=f"{layout}-{event}-{resume}")


# ---- references ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def references(tiny_lm, tmp_path_factory) -> dict:
    """One process's uninterrupted runs (world-size invariant to 1e-5): from scratch (its step_3 is where the path
    setting begins, and its losses from step 4 on are that run's too), and from step_3's weights (init_from)."""
    from shardlab_commands import consolidate

    tmp = tmp_path_factory.mktemp("fault_references")
    scratch = run_rank(tiny_lm(*RUN[len(TINY_LM) :]), tmp / "scratch", dist_env.detect())
    step3 = tmp / "scratch" / "checkpoints" / "step_00000003"
    weights = consolidate.consolidate(step3, tmp / "step3.safetensors")
    initialized = run_rank(
        tiny_lm(*RUN[len(TINY_LM) :], f"checkpoint.init_from={weights}"), tmp / "init", dist_env.detect()
    )
    losses = lambda result: {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}  # noqa: E731
    return {
        "auto": ([], losses(scratch)),
        "none": (["checkpoint.resume=none"], losses(scratch)),
        "path": ([f"checkpoint.resume={step3}"], {s: v for s, v in losses(scratch).items() if s > 3}),
        "init_from": ([f"checkpoint.init_from={weights}"], losses(initialized)),
    }


# ---- launching -------------------------------------------------------------------------------------------------------
@dataclass
class Attempt:
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    out: str = ""

    def wait(self, timeout: float) -> float:
        """Seconds until the launch ended."""
        self.out, _ = self.proc.communicate(timeout=timeout)
        return time.monotonic() - self.started


@dataclass
class Cell:
    layout: str
    event: str
    resume: str
    tmp: Path
    corpus_cache: str
    setting: list[str]
    slurm_env: dict | None
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def fault_dir(self) -> Path:
        return self.tmp / "fault"

    @property
    def run_dir(self) -> Path:
        if self.layout.startswith("slurm"):
            return Path(self.job()["run_dir"])
        return self.tmp / "run"

    def job(self) -> dict:
        return json.loads((self.tmp / "sweep" / "sweep.json").read_text())[0]

    def env(self) -> dict:
        step = SAVE_FAULT_STEP if self.event == "save_fails_rank0" else FAULT_STEP
        kind = {"error_one_rank": "error", "save_fails_rank0": "save_fails"}.get(self.event, "pause")
        rank = 1 if self.event == "error_one_rank" else 0
        fault = {"event": kind, "rank": rank, "step": step, "dir": str(self.fault_dir)}
        base = self.slurm_env or os.environ
        return {
            **base,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{SITE}:{ROOT}",
            "SHARDLAB_FAULT": json.dumps(fault),
        }

    def end_leftovers(self) -> None:
        """A failed cell must not leave its launches (or their Slurm jobs) running."""
        for attempt in self.attempts:
            if attempt.proc.poll() is None:
                os.killpg(attempt.proc.pid, signal.SIGKILL)
                attempt.proc.wait()
        if self.layout.startswith("slurm") and (self.tmp / "sweep" / "sweep.json").is_file():
            subprocess.run(["scancel", self.job()["job_id"]], env=self.slurm_env, capture_output=True)

    @property
    def lost_host(self) -> bool:
        return self.layout == "slurm_2nodes" and self.event in LOST_HOST

    def launch(self) -> Attempt:
        overrides = [*RUN, f"data.cache_dir={self.corpus_cache}", *TWO_RANKS, *self.setting]
        if self.layout == "local":
            cmd = [sys.executable, "-m", "shardlab.train", *overrides, "distributed.world_size=2",
                   f"hydra.run.dir={self.run_dir}"]  # fmt: skip
        elif self.layout == "torchrun":
            # The agent passes these signals on to its workers (it would die of USR2 otherwise): docs/checkpoints.md
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--signals-to-handle={TORCHRUN_SIGNALS}",
                   "--nproc_per_node=2", f"--master_port={free_port()}",
                   "-m", "shardlab.train", *overrides, f"hydra.run.dir={self.run_dir}"]  # fmt: skip
        else:
            ranks = {"slurm_tasks": ["hydra.launcher.tasks_per_node=2"], "slurm_2nodes": MULTI}.get(
                self.layout, ["distributed.world_size=2"]
            )
            cmd = [sys.executable, "-m", "shardlab.train", "-m", *overrides, *ranks, "hydra/launcher=slurm",
                   f"hydra.sweep.dir={self.tmp / 'sweep'}", "hydra.launcher.poll_s=1"]  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.attempts.append(Attempt(proc))
        return self.attempts[-1]

    def pids(self) -> dict[int, int]:
        return {r: int((self.fault_dir / f"pid.rank{r}").read_text()) for r in (0, 1)}

    def deliver(self, attempt: Attempt) -> None:
        """The event, while rank 0 waits inside step FAULT_STEP (errors and failing saves fire by themselves)."""
        if self.event in ("error_one_rank", "save_fails_rank0"):
            return
        wait_for(lambda: (self.fault_dir / "paused").is_file() or attempt.proc.poll() is not None, 240, "the fault")
        assert attempt.proc.poll() is None, attempt.proc.communicate()[0][-3000:]
        sig = {"usr2": signal.SIGUSR2, "sigterm": signal.SIGTERM}.get(self.event)
        if self.event == "kill_one":
            os.kill(self.pids()[1], signal.SIGKILL)
        elif self.event == "kill_all":
            if self.layout.startswith("slurm"):
                self.scontrol_or_scancel(["scancel", "--signal=KILL", self.job()["job_id"]])
            else:
                os.killpg(attempt.proc.pid, signal.SIGKILL)
            for pid in self.pids().values():  # torchrun's workers run in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        elif self.event == "kill_node":
            assert cluster(self.slurm_env, "kill-node", "shl-n2").returncode == 0
        elif self.event == "scontrol_requeue":
            self.scontrol_or_scancel(["scontrol", "requeue", self.job()["job_id"]])
        elif self.layout.startswith("slurm"):
            self.scontrol_or_scancel(["scancel", f"--signal={signal.Signals(sig).name[3:]}", self.job()["job_id"]])
        else:
            os.kill(attempt.proc.pid, sig)  # the launcher only: it passes the signal on to the ranks
        (self.fault_dir / "go").touch()

    def scontrol_or_scancel(self, cmd: list[str]) -> None:
        subprocess.run(cmd, env=self.slurm_env, check=True, capture_output=True)

    def release_requeued_job(self) -> None:
        """Slurm holds a requeued job ~120 s; once it is pending again, start it now (at once it would fail). A lost
        node comes back first, once Slurm has seen it go (as tests/slurm/test_multinode.py does)."""
        if self.lost_host:
            if self.event == "kill_node":
                wait_for(lambda: "down" in node_state(self.slurm_env, "shl-n2"), 120, "Slurm to mark shl-n2 down")
                assert cluster(self.slurm_env, "node-up", "shl-n2").returncode == 0
            start_once_pending(self.slurm_env, self.job()["job_id"])
        else:
            start_requeued_job_now(self.slurm_env, self.job()["job_id"])


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# ---- what each attempt must have said --------------------------------------------------------------------------------
def check_first_attempt(cell: Cell, attempt: Attempt) -> str:
    """The end state of the attempt the fault hit, as the user sees it; returns it in words."""
    rc, out, status = attempt.proc.returncode, attempt.out, run_record.read(cell.run_dir) or {}
    if cell.layout.startswith("slurm"):
        job = cell.job()["job_id"]
        if cell.lost_host:
            assert f"#0 job {job} completed at step {MAX_STEPS}" in out, out[-3000:]
            assert "lost shl-n2 (10.77.0.12, rank 1)" in Path(cell.job()["log"]).read_text()
            return "lost host named; completed after its requeue"
        if cell.event in SLURM_REQUEUES or cell.event == "save_fails_rank0":
            assert f"#0 job {job} completed at step {MAX_STEPS}" in out, out[-3000:]
            return "completed" + (" after a requeue" if cell.event != "save_fails_rank0" else "")
        if cell.event == "sigterm":
            assert f"#0 job {job} stopped at step {FAULT_STEP}" in out, out[-3000:]
            return f"stopped at step {FAULT_STEP}"
        assert f"#0 job {job} failed:" in out, out[-3000:]
        if cell.event == "error_one_rank":
            assert "injected fault on rank 1" in out, out[-3000:]
        return "failed"
    if cell.event == "save_fails_rank0":
        assert rc == 0 and status["status"] == "completed", out[-3000:]
        return "completed"
    if cell.event in ("usr2", "sigterm"):
        assert status["status"] == "stopped" and status["step"] == FAULT_STEP, (status, out[-3000:])
        assert rc == 143 if cell.layout == "local" else rc != 0, out[-3000:]
        return f"stopped at step {FAULT_STEP} (exit {rc})"
    if cell.event == "kill_all":
        assert rc == -signal.SIGKILL and status["status"] == "running", (rc, status)  # died without a word
        return "killed"
    assert rc != 0 and status["status"] == "failed", (rc, status, out[-3000:])
    if cell.event == "error_one_rank":
        assert "injected fault on rank 1" in status["error"], status  # the cause, not rank 0's timeout after it
    return f"failed (exit {rc})"


def checkpoint_steps(cell: Cell) -> list[int]:
    root = cell.run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_????????") if (p / "shardlab.json").is_file())


@pytest.mark.parametrize("layout, event, resume", list(cells()))
def test_fault_matrix_cell(layout, event, resume, references, corpus_cache, tmp_path, request):
    env_fixture = "multi_node_env" if layout == "slurm_2nodes" else "slurm_env"
    slurm_env = request.getfixturevalue(env_fixture) if layout.startswith("slurm") else None
    setting, expected = references[resume]
    cell = Cell(layout, event, resume, tmp_path, corpus_cache, setting, slurm_env)
    cell.fault_dir.mkdir()
    default = (layout, event, resume) in DEFAULT_CELLS
    outcome = {"layout": layout, "event": event, "resume": resume, "default": default, "passed": False}
    started = time.monotonic()
    try:
        first = cell.launch()
        cell.deliver(first)
        delivered = time.time()
        if (layout.startswith("slurm") and event in SLURM_REQUEUES) or cell.lost_host:
            cell.release_requeued_job()
        seconds = first.wait(timeout=600)
        outcome["first_attempt"] = check_first_attempt(cell, first)
        if event not in (*SLURM_REQUEUES, "save_fails_rank0") and not cell.lost_host:  # it must end soon after
            fault_at = max(delivered, (cell.fault_dir / "fired").stat().st_mtime)
            after_fault = time.time() - fault_at
            assert after_fault < TIMEOUT_S + 60, f"a rank hung: the attempt ended {after_fault:.0f} s after the fault"
        saved = checkpoint_steps(cell)  # the last completed save: the requeue must resume exactly there
        requeued_by_slurm = layout.startswith("slurm") and event in SLURM_REQUEUES
        if "completed" not in outcome["first_attempt"]:  # the requeue: the same command again
            second = cell.launch()
            second.wait(timeout=600)
            assert second.proc.returncode == 0 or "completed at step" in second.out, second.out[-3000:]
        if event != "save_fails_rank0":
            log = (cell.run_dir / "train.log").read_text()
            resumed = [int(n) for n in re.findall(r"\] resumed from \S+ \(step (\d+),", log)]
            # A signal saves at the fault's step; a lost host leaves the last periodic save (every 3 steps) before it.
            expected_step = FAULT_STEP if requeued_by_slurm else (FAULT_STEP // 3 * 3 if cell.lost_host else max(saved))
            assert resumed and resumed[-1] == expected_step, (resumed, saved)
            outcome["resumed_at"] = resumed[-1]
        got = dict(scalars(cell.run_dir))
        first_step = 4 if resume == "path" else 1
        assert sorted(got) == list(range(first_step, MAX_STEPS + 1)), sorted(got)
        torch.testing.assert_close(
            torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
            torch.tensor([expected[s] for s in sorted(got)], dtype=torch.float64), rtol=1e-5, atol=0,
        )  # fmt: skip
        outcome.update(passed=True, seconds=round(time.monotonic() - started, 1), first_seconds=round(seconds, 1))
    finally:
        record_cell(outcome)
        cell.end_leftovers()
        if layout == "slurm_2nodes":
            cluster(slurm_env, "node-up", "shl-n2")
