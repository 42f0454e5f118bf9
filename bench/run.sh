#!/usr/bin/env bash
# The suite on a GPU machine: install the carried wheels (bench/fetch_wheels.sh) and autodeploy, run the named
# sections of bench/full_table.py (default: all), one JSON and one log per section in $OUT, then the merged table.
#   bash bench/run.sh decode                          # one section per 10-minute device call
#   bash bench/run.sh decode --shapes=llama8b --batches=1,64   # options as --name=value
#   bash bench/run.sh                                 # every section, ~25 minutes
#   bash bench/run.sh tests [PYTEST ARGS]             # the GPU tests instead (default: every gpu test), $OUT/tests.log
# Without a git checkout (a copy of the working tree), name the commit the header records: BENCH_COMMIT=abc1234
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/ad . >/dev/null 2>&1
export PYTHONPATH=/tmp/ad:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ "${1:-}" = tests ]; then  # -P: the installed autodeploy, not ./autodeploy; Triton's JIT, not the interpreter
  shift; [ $# -gt 0 ] || set -- -m gpu tests/gpu tests/kernels/test_quant_gpu.py
  TRITON_INTERPRET=0 python3 -P -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log"
  exit "${PIPESTATUS[0]}"
fi
sections=() options=()
for arg in "$@"; do case $arg in --*) options+=("$arg") ;; *) sections+=("$arg") ;; esac; done
[ ${#sections[@]} -gt 0 ] || sections=(decode offline serving coldstart kernels structured)
status=0
for s in "${sections[@]}"; do
  python3 bench/full_table.py --sections "$s" --json "$OUT/$s.json" "${options[@]}" 2>&1 | tee "$OUT/$s.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
parts=(); for s in "${sections[@]}"; do [ -f "$OUT/$s.json" ] && parts+=("$OUT/$s.json"); done
[ ${#parts[@]} -eq 0 ] ||
  python3 bench/full_table.py --merge "${parts[@]}" --json "$OUT/table.json" | tee "$OUT/table.txt"
exit $status
