# Shared by the device scripts (sourced, not run): the wheel install, a bounded part, a service benchmark.
#
#   start_run TOTAL_S        a timed run: TOTAL, $OUT (default ./out-device) with its logs/, the wheels installed
#   left                     seconds left of TOTAL
#   install_wheels           the service's packages into /tmp/site, first on PYTHONPATH with the tree: from
#                            .site.tar.xz when carried (bench/device/pack_site.sh: the wheels unpacked and
#                            xz-packed, 36 MB where the wheels with aiortc's take 55), else from the wheels in .whl/
#   part NAME LIMIT_S CMD..  CMD under `timeout`, its stdout / stderr in $PART_DIR (default $OUT) as NAME.std*
#   gpu_tests LIMIT_S FILES..   the GPU-marked tests of FILES under `timeout`, the log in $OUT/gpu_tests.txt
#   service NAME BUDGET_S ARGS...   bench/bench_service_gpu.py (ARGS: its own, then -- and `arstream serve`'s),
#                            JSON in $OUT/service_NAME.json, logs in $OUT/logs; needs TOTAL (start_run)

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
