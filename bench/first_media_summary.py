"""Time to first media per service run, from the bench's JSON and the server's log; prints ONE JSON line per run.

For each `NAME=SERVICE_JSON[:SERVER_LOG]` given: seconds to `/readyz`; the first session after it (client clock:
`start` sent as soon as the socket opened → first media segment, and from before the connect); the later
sessions' (every other case's worst); the server's own `arstream_time_to_first_chunk_seconds` and
`arstream_stream_open_seconds` means per case; and from the log, the start-up's `media encoders warmed` line and,
per session, `session created` → `session started` (the gap issue 23 found: ~0.48 s for the first session, 7 ms
for later ones). A last line says whether every first session met the target (≤ 250 ms).

    python bench/first_media_summary.py standard_bf16=out/service_standard_bf16.json:out/logs/server_standard_bf16.log
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

TARGET_MS = 250.0


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def log_figures(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    warmed, created, gaps = None, {}, []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        event = entry.get("event")
        if event == "media encoders warmed":
            warmed = {k: entry.get(k) for k in ("video_encoder", "audio_encoder", "probe_ms", "stream_ms")}
        elif event == "session created" and entry.get("session_id"):
            created[entry["session_id"]] = _ts(entry["ts"])
        elif event == "session started" and entry.get("session_id") in created:
            gaps.append(round((_ts(entry["ts"]) - created.pop(entry["session_id"])) * 1000.0, 1))
    return {"media_encoders_warmed": warmed, "created_to_started_ms": gaps}


def summary(name: str, service: dict, log: dict) -> dict:
    cases = service.get("cases", {})
    first = cases.get("first_after_ready", {}).get("summary", {})
    later = [case["summary"]["time_to_first_media_ms_max"] for key, case in cases.items()
             if key != "first_after_ready" and case["summary"].get("time_to_first_media_ms_max") is not None]
    server = {}
    for key, case in cases.items():
        counters = case.get("server_counters", {})
        figures = {}
        for metric, label in (("arstream_time_to_first_chunk_seconds", "ttfm_ms_mean"),
                              ("arstream_stream_open_seconds", "stream_open_ms_mean")):
            count = counters.get(f"{metric}_count")
            if count:
                figures[label] = round(counters[f"{metric}_sum"] / count * 1000.0, 1)
        server[key] = figures
    out = {
        "run": name,
        "ready_s": (service.get("startup") or {}).get("ready_s"),
        "startup_error": service.get("startup_error"),
        "first_session_ttfm_ms": first.get("time_to_first_media_ms_max"),
        "first_session_connect_to_media_ms": first.get("connect_to_first_media_ms_max"),
        "first_session_fps": first.get("fps_steady_min"),
        "later_sessions_ttfm_ms": later,
        "server": server,
        **log,
    }
    ttfm = out["first_session_ttfm_ms"]
    out["first_session_met"] = ttfm is not None and ttfm <= TARGET_MS
    return out


def main() -> None:
    results = []
    for argument in sys.argv[1:]:
        name, _, paths = argument.partition("=")
        json_path, _, log_path = paths.partition(":")
        try:
            service = json.loads(Path(json_path).read_text())
        except (OSError, ValueError) as error:
            results.append({"run": name, "error": f"{json_path}: {error}"})
            print(json.dumps(results[-1]))
            continue
        results.append(summary(name, service, log_figures(Path(log_path) if log_path else None)))
        print(json.dumps(results[-1]))
    print(json.dumps({"first_media_target_ms": TARGET_MS,
                      "all_first_sessions_met": bool(results) and all(r.get("first_session_met") for r in results)}))


if __name__ == "__main__":
    main()
