"""Tests marked ``background`` run in child pytests, and the suite reports each as the child ran it: a failure
fails the suite with the child's message (a fixture's as an error), a skip skips, and the node ids are the suite's
(tests/background_pytest.py)."""

import os
import subprocess
import sys

import pytest

from tests import background
from tests.background_pytest import NODEIDS_ENV, RESULTS_ENV

PROBE = '''
import os
import time

import pytest

def test_in_the_suite():
    assert "ARSTREAM_BACKGROUND_RESULTS" not in os.environ
    from tests.background_pytest import _State  # the suite's own: wait until a child took the marked file
    deadline = time.monotonic() + 120  # a bound on a hang, not a speed
    while not any(_State.claims.iterdir()):
        assert time.monotonic() < deadline, "no background pytest took the file"
        time.sleep(0.05)

@pytest.mark.background
def test_passes_there():
    assert "ARSTREAM_BACKGROUND_RESULTS" in os.environ  # it did run in the child

@pytest.mark.background
def test_fails_there():
    assert [1, 2] == [1, 3], "the lists differ"

@pytest.mark.background
def test_skips_there():
    pytest.skip("nothing to do here")

@pytest.fixture
def broken():
    raise RuntimeError("its fixture broke")

@pytest.mark.background
def test_errs_there(broken):
    pass
'''


@pytest.mark.background
def test_the_suite_reports_each_background_test_as_the_child_ran_it(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {key: value for key, value in os.environ.items() if key not in (RESULTS_ENV, NODEIDS_ENV)}
    name, value = background.root_on_path()
    env[name] = value
    # Output to a file, not a pipe: the session's forkserver (tests/server_zygote.py) holds a pipe open while it
    # finishes importing, after the session itself has exited.
    with open(tmp_path / "out.txt", "w") as log:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
             "-c", os.devnull, "-W", "ignore::pytest.PytestUnknownMarkWarning", "-rA", "test_probe.py"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=240,
        )
    out = (tmp_path / "out.txt").read_text()
    assert run.returncode == 1, out
    assert "1 failed, 2 passed, 1 skipped, 1 error" in out, out
    assert "in a background pytest, call" in out and "in a background pytest, setup" in out
    assert "PASSED test_probe.py::test_in_the_suite" in out
    assert "PASSED test_probe.py::test_passes_there" in out
    assert "FAILED test_probe.py::test_fails_there" in out and "AssertionError: the lists differ" in out
    assert "ERROR test_probe.py::test_errs_there" in out and "RuntimeError: its fixture broke" in out
    assert "nothing to do here" in out
    assert "background pytests: 4 tests run by 2 children on idle cores, 0 of their files run here" in out



@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_a_job_runs_under_sched_idle_set_from_the_parent():
    """A background job runs under SCHED_IDLE, which the parent sets once the job has started (no Python runs
    between fork and exec: with gRPC's threads alive, a ``preexec_fn`` child once hung before exec)."""
    # The sleep lets the parent's sched_setscheduler land before the child reads its policy.
    code = "import os, time; time.sleep(0.5); print(os.sched_getscheduler(0))"
    done = background.result(background.Job(argv=(sys.executable, "-c", code)), timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) == os.SCHED_IDLE
