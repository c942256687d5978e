#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, in .whl/ under the 64 MiB a device call may carry with the tree.
# ../shared/gpu/wheels.sh's set, plus what that set misses (measured on an H100 loan, 2026-11-28:
# every step failed at `import soundfile`; torchao for quant=int4wo; openai for the serve step;
# pytest-xdist, which the suite's addopts name: the CUDA steps run with -n 0; found by the CPU rehearsal,
# benchmarks/gpu_rehearse_env.sh (issue 47): fastapi's opentelemetry-api, openai's httpx2 with httpcore2 and
# truststore, and xgrammar with apache-tvm-ffi for constrained decoding),
# less PyAV (35 MB; video only) and bitsandbytes' kernels for CUDA releases other than 13.x
# (the image's torch is cu130): 99 MB -> 37 MB.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/gpu/wheels.sh torchao==0.18.0 soundfile cffi pycparser openai distro jiter sniffio pytest-xdist execnet \
    opentelemetry-api httpx2 httpcore2 truststore xgrammar apache-tvm-ffi >/dev/null
rm -f .whl/av-*.whl
for w in .whl/bitsandbytes-*.whl; do
    zip -q -d "$w" 'bitsandbytes/libbitsandbytes_cuda1[12]*' 'bitsandbytes/libbitsandbytes_rocm*' || true
done
total=$(( $(du -cb .whl/*.whl | tail -1 | cut -f1) + $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) ))
echo "wheels + tracked tree: $((total >> 20)) MiB of the 64 MiB a call carries"
