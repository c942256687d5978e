#!/usr/bin/env bash
# One GPU check, in one call on a lent GPU machine (issue 26). Every step has its own time limit,
# writes its log and JSON into $OUT (default ./gpu-check), and a failing step does not stop the
# others; summary.md and summary.json list each step's exit status, time and figures.
#
#   bash benchmarks/gpu_wheels.sh                  # here, once: the wheels a bare CUDA image lacks
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#          --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu_check.sh
#
# STEPS picks the steps (default: the set below, in its order): STEPS="decode_bf16 batch" bash ...
# LIMIT=SECONDS replaces every step's own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export TMPDIR=${TMPDIR:-/tmp} PYTHONUNBUFFERED=1
STEPS=${STEPS:-"env decode_bf16 decode_int4wo decode_nf4 cuda_tests decode_bf16_fast"}
# Also: batch prefill_16k engine_tests attention speculative serve (STEPS=...): they do not fit one call's
# 15 minutes beside the default set on the lent machines, whose host takes ~20 s to import torch + transformers.
ARCH="--arch qwen2-vl-2b"
DECODE="--image 448 --prompt-tokens 32 --new-tokens 128 --reps 2"
# The roofline: PEAK_GB_S (e.g. 3350 for an H100 SXM's HBM3) or, unset, a device copy measured in each run.
PEAK=${PEAK_GB_S:+--peak-gb-s $PEAK_GB_S}
PY=python3

decode() {  # decode NAME ARGS...: decode_vs_generate's figures for one scheme, into $OUT/NAME.json
    local name=$1; shift
    echo "$PY benchmarks/decode_vs_generate.py $ARCH $* $DECODE ${PEAK} --json $OUT/$name.json"
}

step_cmd() {
    case "$1" in
    env) echo "nvidia-smi; $PY -c 'import torch, transformers, bitsandbytes, torchao; print(torch.__version__, torch.version.cuda, transformers.__version__, bitsandbytes.__version__, torchao.__version__, torch.cuda.get_device_name())'" ;;
    decode_bf16) decode decode_bf16 --quant none --dtype bfloat16 ;;
    decode_bf16_fast) decode decode_bf16_fast --quant none --dtype bfloat16 --fast ;;
    decode_nf4) decode decode_nf4 --quant nf4 ;;
    decode_int4wo) decode decode_int4wo --quant int4wo --dtype bfloat16 ;;
    # -v: each test's name and outcome as it ends, so a step cut at its limit still says which failed
    cuda_tests) echo "$PY -m pytest -n 0 -v --tb=short -p no:cacheprovider --timeout 60 -m 'slow or not slow' tests/test_gpu_path.py tests/test_flex.py tests/test_quant.py tests/test_sampler.py -k '(cuda or gpu_path or flex or quant) and not cli'" ;;
    engine_tests) echo "$PY -m pytest -n 0 -v --tb=short -p no:cacheprovider --timeout 60 tests/test_engine.py" ;;
    attention) echo "$PY benchmarks/paged_attention.py --device cuda --dtype bfloat16" ;;
    batch) echo "$PY benchmarks/engine_throughput.py $ARCH --dtype bfloat16 --requests 32 --new-tokens 32 --max-seqs 1,32 --skip-solo --skip-hf --reps 1 --json $OUT/batch.json" ;;
    prefill_16k) echo "$PY benchmarks/decode_vs_generate.py $ARCH --quant none --dtype bfloat16 --prompt-tokens 16384 --new-tokens 8 --reps 1 --json $OUT/prefill_16k.json" ;;
    speculative) echo "$PY benchmarks/speculative.py --quick --paths plain,ngram-4,draft-4 --skip-hf" ;;
    serve) echo "$PY benchmarks/serve_load.py --concurrency 1,32 --requests 128 --reps 1 --json $OUT/serve.json" ;;
    *) return 1 ;;
    esac
}

limit() {  # seconds per step: the default set ends within 9 minutes whatever hangs (issue 29's figures first)
    case "$1" in env) echo 30 ;; decode_bf16) echo 110 ;; decode_int4wo) echo 80 ;; decode_nf4) echo 80 ;;
        cuda_tests) echo 90 ;; decode_bf16_fast) echo 150 ;; engine_tests) echo 150 ;; batch) echo 120 ;;
        prefill_16k) echo 60 ;; attention) echo 30 ;; speculative) echo 60 ;; serve) echo 60 ;; esac
}

echo "| step | exit | seconds | command |" > "$OUT/summary.md"
echo "|---|---|---|---|" >> "$OUT/summary.md"
echo "[" > "$OUT/summary.json"
sep=""
for s in $STEPS; do
    cmd=$(step_cmd "$s") || { echo "unknown step: $s" >&2; exit 2; }
    t0=$(date +%s%N)
    timeout "${LIMIT:-$(limit "$s")}" bash -c "$cmd" > "$OUT/$s.log" 2>&1
    rc=$?
    dt=$(( ($(date +%s%N) - t0) / 1000000000 ))
    echo "$s: exit $rc in ${dt}s" >&2
    echo "| $s | $rc | $dt | \`$cmd\` |" >> "$OUT/summary.md"
    printf '%s{"step": "%s", "exit": %d, "seconds": %s}' "$sep" "$s" "$rc" "$dt" >> "$OUT/summary.json"
    sep=$',\n'
    tail -n 25 "$OUT/$s.log" | sed 's/^/    /' >> "$OUT/summary.md"
done
echo $'\n]' >> "$OUT/summary.json"
cat "$OUT/summary.md"
