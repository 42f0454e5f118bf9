#!/usr/bin/env bash
# One H200 session: install carried wheels + autodeploy, then the named sections, each time-boxed.
#   bash bench/run_h200.sh smoke decode_ad kernels
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/ad . >/dev/null 2>&1
export PYTHONPATH=/tmp/ad:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
section() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }
config_dir() { [ -d /tmp/cfg8b ] || python3 -c "import sys; sys.path.insert(0, 'bench'); from decode_bench import llama_config; llama_config('llama8b').save_pretrained('/tmp/cfg8b')"; }
serving() {  # issue 3: TPOT at concurrency 1/16/64, then the bare decode step at the same batch sizes
  (cd /tmp && exec python3 -m autodeploy.cli serve /tmp/cfg8b --weights random --dtype bfloat16 --port 8011 \
      --max_batch_size 64 --max_seq_len 1024 --num_kv_blocks 8192 > "$OUT/server.log" 2>&1) &
  local server=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; kill -0 $server 2>/dev/null || break; sleep 1; done
  grep -v -i warn "$OUT/server.log" | tail -25
  for c in 1 16 64; do section "serving_c$c" 90 env -C /tmp python3 -m autodeploy.cli bench serve \
      --base_url http://127.0.0.1:8011 --concurrency $c --num_requests $((c * 4)) --input_len 128 --output_len 128 \
      --vocab_size 128000; done
  curl -s http://127.0.0.1:8011/metrics | grep -E "^autodeploy" | grep -v -E "_bucket|_created" | head -30
  kill $server; wait $server 2>/dev/null
  section decode_at_serving_batches 200 python3 bench/decode_bench.py --impls autodeploy --shapes llama8b \
      --batches 1,16,64 --context 192 --json "$OUT/decode_serving.json"
}
for s in "$@"; do
  case $s in
    smoke) section smoke 200 python3 bench/gpu_smoke.py torch triton ;;
    decode_ad) section decode_ad 360 python3 bench/decode_bench.py --impls autodeploy,engine --json "$OUT/decode_ad.json" ;;
    decode_hf) section decode_hf 420 python3 bench/decode_bench.py --impls hf --json "$OUT/decode_hf.json" ;;
    kernels) section kernels 200 python3 bench/kernels_gpu.py ;;
    sweep) section sweep 300 python3 bench/kernels_gpu.py --sweep ;;
    sweep_b1) section sweep_b1 120 python3 bench/kernels_gpu.py --sweep-only 1x512,8x512 ;;
    sweep_large) section sweep_large 200 python3 bench/kernels_gpu.py --sweep-only 480x192,256x512,64x512 ;;
    context_sweep) section context_sweep 200 python3 bench/kernels_gpu.py \
        --context-sweep 480x192,480x193,480x200,480x256,64x512,256x512 ;;  # key blocks and register cap
    profile_eager) section profile_eager 200 python3 bench/profile_step.py --shape llama8b --batches 1 --eager ;;
    equality) section equality 300 python3 bench/greedy_equality.py --shape llama8b --steps 64 --dtype float32 ;;
    gemm) section gemm 200 python3 bench/gemm_sweep.py ;;
    gemv) section gemv 240 python3 bench/gemv_gpu.py --sweep ;;
    gemv_single) section gemv_single 100 python3 bench/gemv_gpu.py --single ;;
    decode_ab_before)  # bare decode steps of the unfused graph (no GEMV, no PDL)
      section decode_ab_before 200 env AUTODEPLOY_GEMV_MAX_ROWS=0 AUTODEPLOY_PDL=0 python3 bench/decode_bench.py \
          --impls autodeploy --batches 1,64 --label _before --json "$OUT/decode_ab_before.json" ;;&
    decode_ab|decode_ab_before)  # the fused GEMV, then GEMV + PDL (+ engine)
      section decode_ab_gemv 200 env AUTODEPLOY_PDL=0 python3 bench/decode_bench.py --impls autodeploy \
          --batches 1,4 --label _gemv --json "$OUT/decode_ab_gemv.json"
      section decode_ab_pdl 240 python3 bench/decode_bench.py --impls autodeploy,engine --batches 1,4,8,64 \
          --label _gemv_pdl --json "$OUT/decode_ab_pdl.json" ;;
    gemm_small) section gemm_small 150 python3 bench/gemm_sweep.py --shape smollm2 --batches 1,8 ;;
    decode) section decode 560 python3 bench/decode_bench.py --json "$OUT/decode.json" ;;
    coldstart) section coldstart 150 python3 bench/cold_start.py --shape llama8b ;;
    coldstart_workers)  # fresh Triton caches each: threads only, then 15 compile worker processes (A/B, one host)
      for w in 0 15; do TRITON_CACHE_DIR=$(mktemp -d) section coldstart_workers_$w 150 python3 bench/cold_start.py \
          --shape llama8b --compile-workers $w; done ;;
    coldstart_pyc)  # the same with the libraries' bytecode compiled first, as `pip install` does (uv does not)
      export PYTHONPYCACHEPREFIX=/tmp/pyc  # writable wherever site-packages is not; the child inherits it
      section bytecode 300 python3 bench/compile_bytecode.py  # all of sys.path: the prefix hides every __pycache__
      section coldstart_pyc 150 python3 bench/cold_start.py --shape llama8b
      unset PYTHONPYCACHEPREFIX ;;
    offline128) config_dir 8b; section offline128 200 env -C /tmp python3 -m autodeploy.cli bench offline /tmp/cfg8b --weights random \
        --dtype bfloat16 --input_len 128 --output_len 128 --num_requests 512 --max_batch_size 512 --max_num_tokens 8192 \
        --max_seq_len 1024 --output_json "$OUT/offline128.json" --log_level warning
      python3 -c "import json; d = json.load(open('$OUT/offline128.json')); print('first steps (seqs, tokens, ms, waited ms):');
[print('  %4d %5d %8.1f %8.1f' % tuple(r)) for r in d['step_log'][:14]]" ;;
    offline1000) config_dir 8b; section offline1000 240 env -C /tmp python3 -m autodeploy.cli bench offline /tmp/cfg8b --weights random \
        --dtype bfloat16 --input_len 1000 --output_len 1000 --num_requests 512 --max_batch_size 256 --max_num_tokens 8192 \
        --max_seq_len 2048 --output_json "$OUT/offline1000.json" ;;
    offline128_pyspy)  # the same run under py-spy (host-side stacks), summarized over the engine's steps
      config_dir 8b; section offline128_pyspy 240 env -C /tmp /tmp/site/bin/py-spy record --rate 200 --nonblocking --format raw \
        --output "$OUT/offline128.pyspy.txt" -- python3 -m autodeploy.cli bench offline /tmp/cfg8b --weights random \
        --dtype bfloat16 --input_len 128 --output_len 128 --num_requests 512 --max_batch_size 512 --max_num_tokens 8192 \
        --max_seq_len 1024 --log_level warning
      section pyspy_summary 60 python3 bench/stack_summary.py "$OUT/offline128.pyspy.txt" --top 45 \
        --within 'step \(.*serve/engine.py' ;;
    decode_small|decode_b1)  # batch 1 and 8; decode_small then batch 1 with the 8B linears on cuBLAS (GEMV up to 8 MB, as before)
      section decode_small 300 python3 bench/decode_bench.py --impls autodeploy,engine --batches 1,8 \
          --json "$OUT/decode_small.json" ;;&
    decode_small)
      section decode_small_cublas 150 env AUTODEPLOY_GEMV_MAX_WEIGHT_MB=8 python3 bench/decode_bench.py \
          --impls autodeploy,engine --shapes llama8b --batches 1 --set passes.decode_linear.enabled=false \
          --label _cublas --json "$OUT/decode_small_cublas.json" ;;
    decode_peers_b1) section decode_peers_b1 330 python3 bench/decode_bench.py --batches 1 --static-batches 1 \
        --json "$OUT/decode_peers_b1.json" ;;  # HF eager, HF static + compile and autodeploy at batch 1, one run
    decode_big) section decode_big 300 python3 bench/decode_bench.py --impls autodeploy,engine --batches 64,256 \
        --json "$OUT/decode_big.json" ;;
    decode_large)  # the offline run's decode batch (~490 sequences, context ~192): padded graph sizes 480 / 512
      section decode_large 300 python3 bench/decode_bench.py --impls autodeploy,engine --shapes llama8b \
          --batches 448,480,490,512 --context 192 --json "$OUT/decode_large.json" ;;
    profile_b1) section profile_b1 150 python3 bench/profile_step.py --shape llama8b --batches 1 --engine ;;
    profile_large) section profile_large 200 python3 bench/profile_step.py --shape llama8b --batches 480 --context 192 --engine ;;
    serving) config_dir 8b; serving ;;
    timeline)  # where the attention's microseconds go between the GEMVs (trace probes), then its cost in the chain
      section timeline 120 python3 bench/layer_chain.py --timeline --shapes llama8b,smollm2
      section chain_default 150 python3 bench/layer_chain.py --only "linears only;attention default" ;;
    tabulate_ab)  # batch 1 engine without the position tables (RoPE cos/sin computed every step)
      section tabulate_off 180 python3 bench/decode_bench.py --impls autodeploy,engine --batches 1 \
          --set passes.tabulate_positions.enabled=false --label _no_tables --json "$OUT/tabulate_off.json" ;;
    layer_chain) section layer_chain 360 python3 bench/layer_chain.py ;;  # the attention's cost between the GEMVs
    preload_ab)  # batch 1: the attention's first key block before the PDL wait (default) against after it
      section preload_ab_on 180 python3 bench/decode_bench.py --impls autodeploy,engine --batches 1 \
          --json "$OUT/preload_ab_on.json"
      section preload_ab_off 180 env AUTODEPLOY_ATTN_PRELOAD_KV=0 python3 bench/decode_bench.py \
          --impls autodeploy,engine --batches 1 --label _no_preload --json "$OUT/preload_ab_off.json" ;;
    profile) section profile_8b 150 python3 bench/profile_step.py --shape llama8b --batches 1,64 --engine
             section profile_smollm2 120 python3 bench/profile_step.py --shape smollm2 --batches 1,64 ;;
  esac
done
