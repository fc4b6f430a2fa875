"""How many intra-op threads torch runs on the CPU, and how they wait for work.

Measured on a quiet 2-core AMD EPYC machine, the tiny preset's block (256×144, engine alone; docs/BENCHMARKS.md,
"CPU threads"): one thread 446 ms; two threads 308 ms — but beside a busy process on the other core, 1,078 ms,
because OpenMP's idle threads *spin* (libgomp's default) and a spinning thread that shares its core with
another process costs both. Letting them spin only briefly before they sleep (``GOMP_SPINCOUNT=1000``) keeps two
threads' speed when the machine is quiet (294 ms) and most of one thread's when it is not (592 ms beside a busy
core, against 460 for one thread). So the engine takes every core on a small machine (a quarter of them left
to the media encoders and the event loop on larger ones), with the short spin.

The spin limit is read by the OpenMP runtime when it loads, with torch: :func:`limit_spinning` must run before
torch is imported (the command line does it first thing). A value the user set is kept.
"""

from __future__ import annotations

import os

SPIN_ENVIRONMENT = {"GOMP_SPINCOUNT": "1000"}  # libgomp (torch's OpenMP on Linux): spin this long, then sleep


def limit_spinning() -> None:
    """Set the OpenMP runtime's short spin (unless the user chose otherwise); before torch is imported."""
    for name, value in SPIN_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def default_threads(cores: int | None = None) -> int:
    """Intra-op threads when none are configured: every core up to 2, three quarters of them beyond."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores if cores <= 2 else cores - cores // 4)
