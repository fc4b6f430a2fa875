"""Tests marked ``background`` run in child pytests on the idle core; the suite reports their results.

The suite keeps one core busy and leaves the other mostly idle (docs/CONTRIBUTING.md). A test that only
computes — no server, no clock, no budget in seconds that a slow core could run out of — can run beside the
rest: ``pytestmark = pytest.mark.background`` (or the mark on one test). When a session selects such tests *and*
others, conftest hands the marked ones to ``CHILDREN`` child pytests (:mod:`tests.background` jobs, so at idle
CPU priority, started once the other jobs have finished) and keeps them at the end of its own run, files in
reverse order. A file goes to whoever claims it first (an exclusive file in a shared directory): the children
take files from the front, the suite from the back once its other tests are done, so the two ends meet and no
one waits long. For a file a child took, the suite reports each test as the child ran it (setup, call and
teardown, with the child's message and duration); a file it took itself runs in-process. A session of marked
tests alone (``pytest tests/test_runner.py``) runs them in-process as usual.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import background

MARK = "background"
CHILDREN = 2  # share the idle core while the suite runs; take both cores once it is done
RESULTS_ENV = "ARSTREAM_BACKGROUND_RESULTS"  # set in a child: the file its reports go to, one JSON line each
NODEIDS_ENV = "ARSTREAM_BACKGROUND_NODEIDS"  # set in a child: a file of the node ids it may run, one a line
CLAIMS_ENV = "ARSTREAM_BACKGROUND_CLAIMS"  # the directory where a file's first taker leaves its mark
POLL_S = 0.05


class _State:
    jobs: list[background.Job] = []
    claims: Path | None = None
    nodeids: Path | None = None
    owners: dict[str, bool] = {}  # file -> taken by this process
    relayed: int = 0
    read_upto: dict[Path, int] = {}  # a child's report file -> the bytes already read
    phases: dict[str, list[dict]] = {}  # node id -> the phases its child reported so far


def in_child() -> bool:
    return RESULTS_ENV in os.environ


def is_marked(item: pytest.Item) -> bool:
    """Whether ``item`` is one for the child pytests."""
    return item.get_closest_marker(MARK) is not None


def split(items: list[pytest.Item]) -> list[pytest.Item]:
    """In the suite: the marked items moved to the end, files in reverse order, and the children's jobs made; in a
    child: only the items it was given. Called last in collection (after -k and -m)."""
    if in_child():
        wanted = set(Path(os.environ[NODEIDS_ENV]).read_text().splitlines())
        return [item for item in items if item.nodeid in wanted]
    marked = [item for item in items if is_marked(item)]
    rest = [item for item in items if not is_marked(item)]
    if not marked or not rest:
        return items
    files = list(dict.fromkeys(str(item.path) for item in marked))
    _State.claims = Path(tempfile.mkdtemp(prefix="arstream-claims-"))
    # The node ids go in a file beside the claims: an environment value has a size bound.
    _State.nodeids = _State.claims.with_suffix(".nodeids")
    _State.nodeids.write_text("\n".join(item.nodeid for item in marked))
    config = marked[0].config
    same_session = ["--rootdir", str(config.rootpath)]  # so a child's node ids are the suite's
    if config.inipath is not None:
        same_session += ["-c", str(config.inipath)]
    for plugin in config.option.plugins or ():
        same_session += ["-p", plugin]
    argv = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *same_session, *files)
    env = ((RESULTS_ENV, "{scratch}/results.jsonl"), (NODEIDS_ENV, str(_State.nodeids)),
           (CLAIMS_ENV, str(_State.claims)), background.root_on_path())
    # Each child's number in its environment makes the jobs two (a Job is its command and environment).
    _State.jobs = [background.Job(argv=argv, env=(*env, ("ARSTREAM_BACKGROUND_CHILD", str(k)))) for k in range(CHILDREN)]
    order = {path: index for index, path in enumerate(reversed(files))}
    return rest + sorted(marked, key=lambda item: order[str(item.path)])  # sorted() keeps the order within a file


def start() -> None:
    """Once collection is done: the children start after the other jobs (one idle core: one job's result at a time)."""
    for job in _State.jobs:
        background.start_after_others(job)


def _take(item: pytest.Item) -> bool:
    """Whether this process runs ``item``'s file: the first to ask for a file gets it, once and for good."""
    path = str(item.path)
    if path not in _State.owners:
        claims = Path(os.environ[CLAIMS_ENV]) if in_child() else _State.claims
        mark = claims / hashlib.sha1(path.encode()).hexdigest()
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            _State.owners[path] = True
        except FileExistsError:
            _State.owners[path] = False
    return _State.owners[path]


def run_protocol(item: pytest.Item) -> bool | None:
    """conftest's ``pytest_runtest_protocol``: True when this process does not run ``item`` itself (in a child: a
    file someone else took; in the suite: a file a child took, whose reports are relayed), None to run it here."""
    if in_child():
        return None if _take(item) else True
    if not _State.jobs or not is_marked(item) or _take(item):
        return None
    _relay(item)
    return True


def _read_reports() -> None:
    """What the children reported since the last read, each file from where that read stopped."""
    for job in _State.jobs:
        path = background.scratch_of(job) / "results.jsonl"
        if not path.exists():
            continue
        with open(path, "rb") as handle:
            handle.seek(_State.read_upto.get(path, 0))
            data = handle.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written is read once it is whole
        _State.read_upto[path] = _State.read_upto.get(path, 0) + len(whole)
        for line in whole.decode().splitlines():
            entry = json.loads(line)
            _State.phases.setdefault(entry["nodeid"], []).append(entry)


def _child_reports(nodeid: str) -> tuple[list[dict], background.Finished | None]:
    """``nodeid``'s phases as a child reported them, once its teardown is in (or that child's output, if it ended
    without it)."""
    while True:
        ended = all(background.finished(job) for job in _State.jobs)  # before the read: nothing is written after it
        _read_reports()
        phases = _State.phases.get(nodeid, [])
        if any(entry["when"] == "teardown" for entry in phases):
            return phases, None
        if ended:
            return [], background.result(_State.jobs[0], 0)
        time.sleep(POLL_S)


def _relay(item: pytest.Item) -> None:
    """Report ``item`` as the child that took its file ran it."""
    hook = item.ihook
    hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    phases, ended = _child_reports(item.nodeid)
    if not phases:
        tail = "\n".join((ended.stdout + ended.stderr).splitlines()[-30:]) if ended else ""
        phases = [{"when": "call", "outcome": "failed", "duration": 0.0,
                   "text": f"the background pytests ended without reporting this test:\n{tail}"}]
    keywords = {name: 1 for name in item.keywords}
    for phase in phases:
        longrepr = None
        if phase["outcome"] == "failed":
            longrepr = f"[in a background pytest, {phase['when']}]\n{phase['text']}"
        elif phase["outcome"] == "skipped":
            longrepr = (str(item.path), (item.location[1] or 0) + 1, phase["text"])
        report = pytest.TestReport(item.nodeid, item.location, keywords, phase["outcome"], longrepr, phase["when"],
                                   duration=phase["duration"])
        hook.pytest_runtest_logreport(report=report)
    hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    _State.relayed += 1


def record(report: pytest.TestReport) -> None:
    """In a child: one phase's outcome, for the suite to relay."""
    if not in_child():
        return
    text = report.longreprtext if report.failed else ""
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    line = json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                       "duration": report.duration, "text": text})
    with open(os.environ[RESULTS_ENV], "a") as out:
        out.write(line + "\n")


def finish() -> None:
    """At the session's end: the claims directory and the node ids' file removed."""
    if _State.claims is not None:
        shutil.rmtree(_State.claims, ignore_errors=True)
        _State.nodeids.unlink(missing_ok=True)


def summary(terminal) -> None:
    """A line at the end of the run: what the children ran, and how many of their files this process took."""
    if _State.jobs:
        mine = sum(1 for taken in _State.owners.values() if taken)
        terminal.write_line(f"background pytests: {_State.relayed} tests run by {CHILDREN} children on idle cores, "
                            f"{mine} of their files run here once this run's own tests were done")
