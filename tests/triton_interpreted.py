"""Run a test module's ``--interpreter-checks`` in a subprocess under Triton's interpreter, and return its JSON.

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported, so the kernel checks run in their own
process (the rest of the session keeps the compiled-Triton behaviour); the module prints one JSON line last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def interpreter_checks(module_file: str, timeout_s: float = 240) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, module_file, "--interpreter-checks"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
