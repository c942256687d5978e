#!/usr/bin/env bash
# A CPU rehearsal of a lent GPU machine's Python (issue 47): a module missing from the carried wheels
# stopped the 2026-11-28 GPU run; here the same imports and tests catch that before device time is spent.
# DIR/venv: Python 3.12 with the image's packages (benchmarks/gpu_image.txt, reused while DIR/.done holds
# that file's sha256); DIR/site: .whl/*.whl installed exactly as on the GPU machine.
#   bash benchmarks/gpu_rehearse_env.sh DIR && source DIR/env.sh && cd "$(git rev-parse --show-toplevel)"
#   $PY -m pytest -n 0 -p no:cacheprovider tests/test_gpu_path.py      # PYTHONPATH=DIR/site:<repo root>
set -euo pipefail
dir=$(mkdir -p "${1:?usage: gpu_rehearse_env.sh DIR}" && cd "$1" && pwd)
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
sum=$(sha256sum benchmarks/gpu_image.txt | cut -d' ' -f1)

if [ "$(cat "$dir/.done" 2>/dev/null)" != "$sum" ]; then
    if python3.12 -c '' 2>/dev/null; then py=python3.12
    elif py=$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1) && [ -n "$py" ]; then :
    else py=python3; echo "no Python 3.12 here: the venv uses $(python3 --version) (the image has 3.12.3)"; fi
    rm -rf "$dir/venv" "$dir/.done"
    "$py" -m venv "$dir/venv"
    "$dir/venv/bin/python" -m pip install -q --upgrade pip
    "$dir/venv/bin/python" -m pip install -q -r benchmarks/gpu_image.txt
    echo "$sum" > "$dir/.done"
fi

# the wheels: downloaded when .whl/ has none, or gpu_wheels.sh changed since
if ! ls .whl/*.whl >/dev/null 2>&1 || [ benchmarks/gpu_wheels.sh -nt .whl ]; then bash benchmarks/gpu_wheels.sh; fi
rm -rf "$dir/site"
"$dir/venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$dir/site" .whl/*.whl

printf 'PY=%s\nPYTHONPATH=%s\nexport PY PYTHONPATH\n' "$dir/venv/bin/python" "$dir/site:$root" > "$dir/env.sh"
echo "PY=$dir/venv/bin/python"
echo "PYTHONPATH=$dir/site:$root"
