"""The trainer's CLI run many times for the price of one start: a server process imports ``shardlab.train`` (and what
a refused command imports: torch, the backends, the checks) once, then forks a fresh child per command, which runs the
console entry point ``shardlab.train.cli`` with that command's argv, environment and working directory, its stdout and
stderr in files, and exits with the code the CLI exits with.

Why: a refusal is ~0.5 s of work behind ~3 s of imports (torch, torch.distributed.tensor, Hydra), and test_cli's
refusal cases paid those imports 27 times. Each child is still a process of its own (its own Hydra state, sys.argv,
signal handlers, exit code, what it writes), so a case checks exactly what ``python -m shardlab.train`` would show the
user; the tests that need a true interpreter start (``--help``, the working directory on sys.path, a real run) still
start one. The warm-up imports only save time: a module it misses the child imports itself.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVER = r"""
import atexit, importlib, json, os, sys, traceback

import shardlab.train

# What a refusal imports, loaded once before the forks (a name that moves fails here, loudly, instead of silently
# leaving each fork to pay for it again).
for name in ("torch", "torch.distributed.tensor", "hydra.utils", "shardlab.cli.checks", "shardlab.cli.axis_checks",
             "shardlab.jobs.sweep", "shardlab.distributed.join", "shardlab.runner"):
    importlib.import_module(name)
from shardlab.distributed import load_backends
load_backends()

def run(case):
    os.chdir(case["cwd"])
    for key, value in case["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = ["shardlab-train", *case["args"]]
    code = 0
    try:
        shardlab.train.cli()
    except SystemExit as e:  # as the interpreter turns it into an exit code
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at its end
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        run(json.loads(line))
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


class CliForks:
    """One server (a test module's fixture holds it); ``run(*args, env=..., cwd=...)`` is one CLI command."""

    def __init__(self, scratch: Path, environ: dict[str, str] | None = None):
        """``environ``: the server's environment (default: this process's now), which every command starts from."""
        self.scratch = scratch
        self.count = 0
        env = {**(os.environ if environ is None else environ), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a command that hangs goes down with the server
        )

    def run(self, *args: str, env: dict[str, str | None] | None = None, cwd: Path = ROOT, timeout: float = 300):
        self.count += 1
        out, err = self.scratch / f"{self.count}.out", self.scratch / f"{self.count}.err"
        case = {"args": list(args), "env": env or {}, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.server.stdin.write(json.dumps(case) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        if not ready:
            os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
            raise TimeoutError(f"the CLI did not end within {timeout} s: {args}")
        line = self.server.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI server ended (exit code {self.server.wait()}) at {args}")
        return Result(json.loads(line), out.read_text(), err.read_text())

    def close(self) -> None:
        if self.server.poll() is None:
            self.server.stdin.close()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
