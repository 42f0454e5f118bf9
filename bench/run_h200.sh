#!/usr/bin/env bash
# One H200 session: install carried wheels + autodeploy, then the named sections, each time-boxed.
#   bash bench/run_h200.sh smoke decode_ad kernels
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/ad . >/dev/null 2>&1
export PYTHONPATH=/tmp/ad:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
section() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }
for s in "$@"; do
  case $s in
    smoke) section smoke 200 python3 bench/gpu_smoke.py torch triton ;;
    decode_ad) section decode_ad 300 python3 bench/decode_bench.py --impls autodeploy --json "$OUT/decode_ad.json" ;;
    decode_hf) section decode_hf 420 python3 bench/decode_bench.py --impls hf --json "$OUT/decode_hf.json" ;;
    kernels) section kernels 200 python3 bench/kernels_gpu.py ;;
    profile) section profile_8b 150 python3 bench/profile_step.py --shape llama8b --batches 1,64
             section profile_smollm2 120 python3 bench/profile_step.py --shape smollm2 --batches 1,64 ;;
  esac
done
