"""Run a test module's ``--interpreter-checks`` in a subprocess under Triton's interpreter, and return its JSON.

``TRITON_INTERPRET=1`` must be set before ``triton`` is imported, so the kernel checks run in their own
process (the rest of the session keeps the compiled-Triton behaviour); the module prints one JSON line last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests import background
from tests.background import Job, root_on_path

ROOT = Path(__file__).resolve().parent.parent


def interpreter_job(module_file: str) -> Job:
    """The module's ``--interpreter-checks`` as a background job (tests/background.py): list it in the module's
    ``BACKGROUND_JOBS`` and the session starts it early, on the core the other tests leave idle."""
    # One BLAS thread: the job has one idle core; more threads only take it from the background pytest children.
    return Job((sys.executable, str(Path(module_file).resolve()), "--interpreter-checks"),
               env=(("TRITON_INTERPRET", "1"), root_on_path(), *((name, "1") for name in BLAS_THREADS)))


BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def interpreter_checks(module_file: str, timeout_s: float = 240) -> dict:
    done = background.result(interpreter_job(module_file), timeout_s)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def patch_interpreter() -> None:
    """Make Triton's interpreter round float32 to e4m3 / bf16 to nearest-even, as the GPU does, and let a
    lone tensor element serve as an index (the FP8 kernel does both)."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    convert, patch_tensor = interpreter._convert_float, interpreter._patch_lang_tensor  # fail loudly if renamed

    torch_types = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.int16)}

    def convert_rne(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype in (tl.float32, tl.float16) and output_dtype in torch_types:
            dtype, bits = torch_types[output_dtype]
            values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))  # float16 -> float32 is exact
            return values.to(dtype).view(bits).numpy()
        return convert(data, input_dtype, output_dtype, rounding_mode)

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._convert_float = convert_rne
    interpreter._patch_lang_tensor = patch_tensor_index
