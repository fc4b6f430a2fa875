# Shared by the device scripts (sourced, not run): the wheel install, a bounded part, a service benchmark.
#
#   start_run TOTAL_S        a timed run: TOTAL, $OUT (default ./out-device) with its logs/, the wheels installed
#   left                     seconds left of TOTAL
#   install_wheels           the service's packages into /tmp/site, first on PYTHONPATH with the tree: from
#                            .site.tar.xz when carried (bench/device/pack_site.sh: the wheels unpacked and
#                            xz-packed, 36 MB where the wheels with aiortc's take 55), else from the wheels in .whl/
#   part NAME LIMIT_S CMD..  CMD under `timeout`, its stdout / stderr in $PART_DIR (default $OUT) as NAME.std*
#   last_line NAME [CHARS]   a part's JSON line (its stdout's last) into $OUT/NAME.json, printed (CHARS, default
#                            2500) after the last two lines of its stderr
#   gpu_tests LIMIT_S FILES..   the GPU-marked tests of FILES under `timeout`, the log in $OUT/gpu_tests.txt
#   service NAME BUDGET_S ARGS...   bench/bench_service_gpu.py (ARGS: its own, then -- and `arstream serve`'s),
#                            JSON in $OUT/service_NAME.json, logs in $OUT/logs; needs TOTAL (start_run)
#   fp8_service WHAT NAME    one of issue 31's services of the 1.3B model (random bf16, `--fp8 all`), if time is
#                            left: WHAT fast = the fast config's paced viewers (VIEWERS, default 3; budget FAST_S),
#                            standard = the standard window pacing off, standard_e4m3 = the same with e4m3 decode
#                            convolutions (budget STANDARD_S); a fresh `arstream serve`, the first session after
#                            /readyz included; NAME_SUFFIX is appended to NAME (e.g. with ARSTREAM_ENGINE__* set)
#   decode_summary FILE [TOP]   bench/shifted_rows_conv_gpu.py's decode record: each path's median, PSNR and
#                            largest difference, each profile's total, kinds and TOP largest kernels (default 14)

start_run() {
  TOTAL=$1
  OUT=${OUT:-$PWD/out-device}
  mkdir -p "$OUT/logs"
  install_wheels
}

left() { echo $(( TOTAL - SECONDS )); }

install_wheels() {
  if [ -f .site.tar.xz ]; then
    mkdir -p /tmp/site && tar -xJf .site.tar.xz -C /tmp/site || { echo "site unpack failed"; exit 1; }
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  fi
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
}

part() {
  local name=$1 limit=$2 dir=${PART_DIR:-$OUT}; shift 2
  echo "== $SECONDS s: $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$dir/$name.stdout" 2> "$dir/$name.stderr"
  echo "$name exit $?"
}

last_line() {
  tail -n 1 "$OUT/$1.stdout" > "$OUT/$1.json"; tail -n 2 "$OUT/$1.stderr"; cut -c1-"${2:-2500}" "$OUT/$1.json"
}

gpu_tests() {
  local limit=$1; shift
  timeout -k 5 "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$OUT/gpu_tests.txt" 2>&1
  echo "gpu tests exit $?: $(tail -n 1 "$OUT/gpu_tests.txt")"
}

service() {
  local name=$1 budget=$2; shift 2
  mkdir -p "$OUT/logs"
  echo "== $(left)s left: service $name, budget ${budget}s"
  timeout -k 20 "$(( budget + 15 ))" python3 bench/bench_service_gpu.py --budget-s "$budget" --no-engine-reference \
    --out "$OUT/service_$name.json" --server-log "$OUT/logs/server_$name.log" "$@" \
    > /dev/null 2> "$OUT/logs/service_$name.stderr"
  echo "service $name exit $?"
  python3 - "$OUT/service_$name.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print(json.dumps({"startup": r.get("startup"), "startup_error": r.get("startup_error"), "skipped": r.get("skipped"),
                  "cases": {k: v["summary"] for k, v in r.get("cases", {}).items()}})[:2500])
PY
}

fp8_service() {
  local what=$1 name=$2${NAME_SUFFIX:-} budget
  local server=(--preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights)
  case $what in fast) budget=${FAST_S:-170} ;; *) budget=${STANDARD_S:-140} ;; esac
  if [ "$(left)" -lt $(( budget + 15 )) ]; then echo "$name skipped ($(left)s left)"; return; fi
  case $what in
    fast) ARSTREAM_ENGINE__FP8=all ARSTREAM_ENGINE__VIDEO_DECODER=taehv service "$name" "$budget" \
            --concurrency "${VIEWERS:-3}" --pacing on --duration "${DURATION:-20}" --first-duration 10 \
            --no-transitions -- "${server[@]}" --window-frames 6 ;;
    standard) ARSTREAM_ENGINE__FP8=all service "$name" "$budget" --concurrency 1 --pacing off --duration 12 \
                --first-duration 12 --no-transitions -- "${server[@]}" ;;
    standard_e4m3) ARSTREAM_ENGINE__FP8=all ARSTREAM_ENGINE__DECODE_CONVS=triton_fp8 service "$name" "$budget" \
                     --concurrency 1 --pacing off --duration 12 --first-duration 12 --no-transitions \
                     -- "${server[@]}" ;;
    *) echo "unknown service $what" ;;
  esac
}

decode_summary() {
  python3 - "$1" "${2:-14}" <<'PY' || true
import json, sys
r = json.loads(open(sys.argv[1]).read())
for d in r.get("decode", []):
    for name, v in d.items():
        if name.endswith("_profile"):
            print(name, v["ms_per_block_total"], v["ms_per_block_by_kind"])
            for row in v["largest"][:int(sys.argv[2])]:
                print("   ", row[1], row[2], row[0][:110])
        elif isinstance(v, dict) and "ms_per_block_median" in v:
            print(name, {k: v.get(k) for k in ("ms_per_block_median", "psnr_db", "uint8_max_diff", "vs_kernel_fp8")})
PY
}
