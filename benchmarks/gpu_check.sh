#!/usr/bin/env bash
# One GPU check, in one call on a lent GPU machine (issue 26). Every step has its own time limit,
# writes its log and JSON into $OUT (default ./gpu-check), and a failing step does not stop the
# others; summary.md and summary.json list each step's exit status, time and figures.
#
#   bash ../shared/gpu/wheels.sh                   # here, once: the wheels a bare CUDA image lacks
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#          --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu_check.sh
#
# STEPS (default: all, in this order) picks some: STEPS="decode_bf16 decode_nf4" bash ...
# LIMIT=SECONDS replaces every step's own time limit.
# FAST= leaves the compiled row out of the decode steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export TMPDIR=${TMPDIR:-/tmp} PYTHONUNBUFFERED=1
STEPS=${STEPS:-"env cuda_tests attention decode_bf16 decode_nf4 decode_int4wo batch prefill_16k speculative serve"}
ARCH="--arch qwen2-vl-2b"
# The roofline: PEAK_GB_S (e.g. 3350 for an H100 SXM's HBM3) or, unset, a device copy measured in each run.
PEAK=${PEAK_GB_S:+--peak-gb-s $PEAK_GB_S}
PY=python3

step_cmd() {
    case "$1" in
    env) echo "nvidia-smi; $PY -c 'import torch, transformers, bitsandbytes; print(torch.__version__, torch.version.cuda, transformers.__version__, bitsandbytes.__version__, torch.cuda.get_device_name())'" ;;
    cuda_tests) echo "$PY -m pytest -q -k cuda tests/test_sampler.py tests/test_gpu_path.py" ;;
    attention) echo "$PY benchmarks/paged_attention.py --device cuda --dtype bfloat16" ;;
    decode_bf16) echo "$PY benchmarks/decode_vs_generate.py $ARCH --quant none --dtype bfloat16 ${FAST---fast} --image 448 --prompt-tokens 32 --new-tokens 256 --reps 2 ${PEAK} --json $OUT/decode_bf16.json" ;;
    decode_nf4) echo "$PY benchmarks/decode_vs_generate.py $ARCH --quant nf4 ${FAST---fast} --image 448 --prompt-tokens 32 --new-tokens 256 --reps 2 ${PEAK} --json $OUT/decode_nf4.json" ;;
    decode_int4wo) echo "$PY benchmarks/decode_vs_generate.py $ARCH --quant int4wo --dtype bfloat16 ${FAST---fast} --image 448 --prompt-tokens 32 --new-tokens 256 --reps 2 ${PEAK} --json $OUT/decode_int4wo.json" ;;
    batch) echo "$PY benchmarks/engine_throughput.py $ARCH --dtype bfloat16 --requests 64 --new-tokens 32 --max-seqs 1,16,64 --skip-solo --skip-hf --reps 1 --json $OUT/batch.json" ;;
    prefill_16k) echo "$PY benchmarks/decode_vs_generate.py $ARCH --quant none --dtype bfloat16 --prompt-tokens 16384 --new-tokens 8 --reps 1 --json $OUT/prefill_16k.json" ;;
    speculative) echo "$PY benchmarks/speculative.py --quick --paths plain,ngram-4,draft-4 --skip-hf" ;;
    serve) echo "$PY benchmarks/serve_load.py --concurrency 1,32 --requests 128 --reps 1 --json $OUT/serve.json" ;;
    *) return 1 ;;
    esac
}

limit() {  # seconds per step: 540 in all, so the default set ends within 9 minutes whatever hangs
    case "$1" in env) echo 20 ;; cuda_tests) echo 55 ;; decode_bf16) echo 100 ;; decode_nf4) echo 70 ;; attention) echo 20 ;;
        decode_int4wo) echo 70 ;; batch) echo 75 ;; prefill_16k) echo 40 ;; speculative) echo 45 ;; serve) echo 45 ;; esac
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
