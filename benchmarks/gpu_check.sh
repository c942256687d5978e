#!/usr/bin/env bash
# The GPU check, in one call on a lent GPU machine (issues 26, 47). Every step has its own time limit
# and writes its log into $OUT (default ./gpu-check); a failing step does not stop the others. The
# figures come from one Python process (benchmarks/gpu_figures.py: imports paid once, each step's JSON
# written as it ends); summary.md and summary.json list every step (each figure too) with its exit
# status and seconds.
#
#   REHEARSE=1 bash benchmarks/gpu_check.sh        # here, on the CPU, before any GPU time is spent
#   bash benchmarks/gpu_wheels.sh                  # here, once: the wheels a bare CUDA image lacks
#   run: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#          --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD bash benchmarks/gpu_check.sh
#
# REHEARSE=1 builds (once; REHEARSE_DIR, default $TMPDIR/mm-rehearse) Python 3.12 with the GPU image's
# packages (gpu_image.txt) and the carried wheels installed as the GPU call installs them
# (gpu_rehearse_env.sh), then runs every step at tiny size on the CPU under the same limits.
# STEPS picks the steps (default: the set below, in its order): STEPS="figures cuda_tests" bash ...
# LIMIT=SECONDS replaces every step's own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
rm -f "$OUT/steps.jsonl"
export TMPDIR=${TMPDIR:-/tmp} PYTHONUNBUFFERED=1
PY=python3
SIZE=""
if [ "${REHEARSE:-0}" = 1 ]; then
    dir=${REHEARSE_DIR:-$TMPDIR/mm-rehearse}
    t0=$(date +%s)
    bash benchmarks/gpu_rehearse_env.sh "$dir" > "$OUT/rehearse_env.log" 2>&1 \
        || { echo "building the rehearsal environment failed: see $OUT/rehearse_env.log" >&2; exit 1; }
    echo "rehearsal environment ready in $(( $(date +%s) - t0 )) s: $(tail -2 "$OUT/rehearse_env.log" | tr '\n' ' ')" >&2
    source "$dir/env.sh"  # PY and PYTHONPATH, as the GPU call sets them
    SIZE=--rehearse
fi
STEPS=${STEPS:-"figures cuda_tests figures_more"}
# The headline figures first; then the CUDA-marked tests; then what decides defaults (FlexAttention
# against SDPA under CUDA graphs) and Inductor's compiled step, whose warm-up may not fit.
FIRST=env,decode_bf16,decode_nf4,decode_int4wo,batch,prefill_16k
MORE=decode_bf16_flex,decode_bf16_compiled

step_cmd() {
    case "$1" in
    figures) echo "$PY benchmarks/gpu_figures.py --out $OUT --steps $FIRST $SIZE" ;;
    figures_more) echo "$PY benchmarks/gpu_figures.py --out $OUT --steps $MORE $SIZE" ;;
    # -v: each test's name and outcome as it ends, so a step cut at its limit still says which failed
    # what a GPU changes: CUDA graphs, the host discipline, 4-bit loading, sampling on the device, FlexAttention
    # on Triton (its CPU-only and slow per-family cases left to the CPU suite)
    cuda_tests) echo "$PY -m pytest -n 0 -v --tb=short -p no:cacheprovider --timeout 60 -m 'slow or not slow' tests/test_cuda_graphs.py tests/test_gpu_path.py tests/test_quant.py tests/test_sampler.py tests/test_flex.py -k '(cuda or gpu_path or graphs or flex or quant) and not cli and not every_family and not no_recompilation'" ;;
    engine_tests) echo "$PY -m pytest -n 0 -v --tb=short -p no:cacheprovider --timeout 60 tests/test_engine.py" ;;
    attention) echo "$PY benchmarks/paged_attention.py --device cuda --dtype bfloat16" ;;
    speculative) echo "$PY benchmarks/speculative.py --quick --paths plain,ngram-4,draft-4 --skip-hf" ;;
    serve) echo "$PY benchmarks/serve_load.py --concurrency 1,32 --requests 128 --reps 1 --json $OUT/serve.json" ;;
    *) return 1 ;;
    esac
}

limit() {  # seconds per step: the default set ends within 9 minutes whatever hangs, the headline figures within 6
    case "$1" in figures) echo 330 ;; cuda_tests) echo 100 ;; figures_more) echo 110 ;; engine_tests) echo 150 ;;
        attention) echo 30 ;; speculative) echo 60 ;; serve) echo 60 ;; esac
}

for s in $STEPS; do
    cmd=$(step_cmd "$s") || { echo "unknown step: $s" >&2; exit 2; }
    t0=$(date +%s%N)
    timeout "${LIMIT:-$(limit "$s")}" bash -c "$cmd" > "$OUT/$s.log" 2>&1
    rc=$?
    dt=$(( ($(date +%s%N) - t0) / 1000000000 ))
    echo "$s: exit $rc in ${dt}s" >&2
    case "$s" in figures*) ;; *) printf '{"step": "%s", "exit": %d, "seconds": %s}\n' "$s" "$rc" "$dt" >> "$OUT/steps.jsonl" ;; esac
    # a figures process killed at its limit: the figure it was in has no line yet
    if [ "$rc" != 0 ] && [[ $s == figures* ]]; then
        printf '{"step": "%s (cut at its limit)", "exit": %d, "seconds": %s}\n' "$s" "$rc" "$dt" >> "$OUT/steps.jsonl"
    fi
done

# summary.json: every line of steps.jsonl; summary.md: the same as a table, with each log's tail
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
(out / "summary.json").write_text(json.dumps(steps, indent=1) + "\n")
lines = ["| step | exit | seconds |", "|---|---|---|"] + [f"| {s['step']} | {s['exit']} | {s['seconds']} |" for s in steps]
for log in sorted(out.glob("*.log")):
    lines += ["", f"### {log.name} (last lines)", "```", *log.read_text(errors="replace").splitlines()[-25:], "```"]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines[: len(steps) + 2]))
EOF
