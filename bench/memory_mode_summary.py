"""The service under a device-memory cap (`--gpu-memory-gib`), from the bench's JSON and the server's log; ONE JSON line.

Reads `bench/bench_service_gpu.py`'s output for a server started with `--gpu-memory-gib GIB` and says whether it
served one live session within the cap: capacity at ready, the first session's time to first media (a new prompt:
the CPU text encode is in it), a later paced session's (the same prompt: an embedding cache hit) with its misses,
a second paced viewer (refused when one session is all the cap holds), the allocator's peak against its cap
(`/metrics`), the whole card's memory as nvidia-smi saw it during each case (the CUDA context included: what a
card of that size must hold), and from the log the measured activation peak and budget, and each prompt encode's
time and thread.

    python bench/memory_mode_summary.py 24 out/service_gib24.json out/logs/server_gib24.log
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MIB = 2**20


def main() -> None:
    gib, json_path, log_path = float(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None
    try:
        result = json.loads(json_path.read_text())
    except (OSError, ValueError) as error:
        print(json.dumps({"error": f"{json_path}: {error}"}))
        return
    cases = result.get("cases", {})
    out: dict = {"gpu_memory_gib": gib, "ready_s": (result.get("startup") or {}).get("ready_s"),
                 "startup_error": result.get("startup_error"), "capacity": result.get("capacity")}
    for name, case in cases.items():
        summary = case["summary"]
        out[name] = {k: summary.get(k) for k in ("served", "refused", "fps_steady_min", "time_to_first_media_ms_max",
                                                 "deadline_misses", "gaps_over_1_5x")}
        out[name]["card_memory_mib_max"] = (case.get("gpu") or {}).get("memory_mib_max")
        refusals = [s["refused"] for s in case["sessions"] if "refused" in s]
        if refusals:
            out[name]["refusals"] = refusals
    gauges = {}
    for case in cases.values():
        gauges.update(case.get("server_gauges") or {})
    peak, limit = gauges.get("arstream_device_memory_peak_bytes"), gauges.get("arstream_device_memory_limit_bytes")
    out["allocator_peak_mib"] = round(peak / MIB, 1) if peak else None
    out["allocator_limit_mib"] = round(limit / MIB, 1) if limit else None
    card = [(c.get("gpu") or {}).get("memory_mib_max") for c in cases.values()]
    card = [m for m in card if m is not None]
    out["card_memory_mib_max"] = max(card) if card else None
    encodes, budget = [], None
    if log_path is not None and log_path.is_file():
        for line in log_path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == "prompt encoded":
                encodes.append({k: entry.get(k) for k in ("encode_ms", "background", "encode_thread", "prompt_length")})
            elif entry.get("event") == "cuda memory budget":
                budget = {k: round(entry[k] / MIB, 1) if isinstance(entry.get(k), (int, float)) else entry.get(k)
                          for k in ("free", "activation_peak", "budget", "allocator_limit", "resident_with_probe_pool",
                                    "allocated_after_probe", "reserved_after_probe")}
    out["prompt_encodes"] = encodes
    out["cuda_memory_budget_mib"] = budget
    paced = out.get("n1_pace_on") or {}
    out["fits"] = bool(
        out["capacity"] and out["capacity"] >= 1 and peak is not None and limit is not None and peak <= limit
        and out["card_memory_mib_max"] is not None and out["card_memory_mib_max"] <= gib * 1024
        and paced.get("served") == 1 and paced.get("deadline_misses") == 0
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
