"""Long, self-contained subprocess checks started when the session starts, at idle CPU priority.

Most of the suite runs one torch thread at a time, so on the 2-core CI machine one core is mostly idle. A
module whose check is a subprocess of its own (the Triton interpreter's kernel checks, the sm_90 compile
sweep) names it in a module-level ``BACKGROUND_JOBS``; once collection is done, conftest starts every
selected module's jobs under ``SCHED_IDLE`` (Linux runs them only on a core nothing else wants, so a test
that times something beside them is not slowed), and the module's fixture waits for the job's result. A
job nobody started early (its module run another way) starts when its result is first asked for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Job:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # over this process's environment
    unset: tuple[str, ...] = ()  # taken out of it
    # "{scratch}" in argv or an env value is the job's own directory (what it writes there is read after it finished).


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    scratch: Path  # kept until the session ends


@dataclass
class _Running:
    process: subprocess.Popen
    where: Path
    finished: Finished | None = field(default=None)


_running: dict[Job, _Running] = {}
_lock = threading.Lock()  # start() is called from the session and from start_after_others' thread
_stopped = threading.Event()  # the session ended: nothing starts any more


def root_on_path() -> tuple[str, str]:
    """The ``PYTHONPATH`` entry (for a Job's ``env``) that lets a job import the project from its root."""
    return "PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def _idle_priority(pid: int) -> None:
    """Set from the parent, just after the start: the job runs only on otherwise idle CPU (a nice of 19 where
    SCHED_IDLE is missing); the threads and processes it starts inherit that. Not a ``preexec_fn``: Python code
    between fork and exec can deadlock in a process whose other threads hold locks (gRPC's and Ray's, once the
    cluster tests ran), and the session then waited on that child for good."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 19)
        except OSError:
            pass  # it has already exited


def start(job: Job) -> None:
    with _lock:
        if job not in _running and not _stopped.is_set():
            _running[job] = _launch(job)


def _launch(job: Job) -> _Running:
    where = Path(tempfile.mkdtemp(prefix="arstream-job-"))
    (where / "scratch").mkdir()

    def scratch(text: str) -> str:
        return text.replace("{scratch}", str(where / "scratch"))

    argv = [scratch(part) for part in job.argv]
    env = {**os.environ, **{name: scratch(value) for name, value in job.env}}
    for name in job.unset:
        env.pop(name, None)
    with open(where / "stdout", "w") as stdout, open(where / "stderr", "w") as stderr:  # no pipe to fill
        process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=stdout, stderr=stderr)
    _idle_priority(process.pid)
    return _Running(process, where)


def start_after_others(job: Job) -> None:
    """Start ``job`` once every job already running has exited (they share one idle core: one at a time gets
    each job its result soonest); at once if its result is asked for first."""
    with _lock:
        others = [running.process for running in _running.values()]

    def wait_then_start() -> None:
        for process in others:
            process.wait()
        start(job)

    threading.Thread(target=wait_then_start, name="background-after-others", daemon=True).start()


def finished(job: Job) -> bool:
    """Whether ``job`` was started and has exited."""
    running = _running.get(job)
    return running is not None and running.process.poll() is not None


def scratch_of(job: Job) -> Path:
    """The job's own directory ("{scratch}"), readable while it runs (a path that does not exist before it starts)."""
    running = _running.get(job)
    return running.where / "scratch" if running is not None else ROOT / "no-such-job-scratch"


def result(job: Job, timeout_s: float) -> Finished:
    """The job's exit status and output, once it has finished (started now if it was not)."""
    start(job)
    running = _running[job]
    if running.finished is None:
        running.process.wait(timeout=timeout_s)
        running.finished = Finished(running.process.returncode, (running.where / "stdout").read_text(),
                                    (running.where / "stderr").read_text(), running.where / "scratch")
    return running.finished


def start_for(modules) -> None:
    """Start the jobs the given test modules name (conftest, once collection is done)."""
    for module in modules:
        for job in getattr(module, "BACKGROUND_JOBS", ()):
            start(job)


def stop_all() -> None:
    """At the session's end: what nobody waited for is killed, and every job's files removed."""
    with _lock:
        _stopped.set()
    for running in _running.values():
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait()
        shutil.rmtree(running.where, ignore_errors=True)
    _running.clear()
