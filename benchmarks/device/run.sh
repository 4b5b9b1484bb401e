#!/usr/bin/env bash
# On the lent device machine, in the repository's copy there: installs what .whl/ carries
# (benchmarks/device/bundle.sh built it here) beside the image's torch, hides the GPU, and runs a
# command with the package importable. Results go under $OUT, which comes back.
#
#     bash benchmarks/device/run.sh python3 benchmarks/device/goals.py --out "$OUT"
set -euo pipefail
[ -d .whl ] || { echo "no .whl/: build it with benchmarks/device/bundle.sh and name .whl in carry" >&2; exit 2; }
site=/tmp/site
if [ ! -f "$site/.installed" ]; then  # a warm machine keeps /tmp between calls
    mkdir -p "$site"
    tar -xJf .whl/ray-stripped.tar.xz -C "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    touch "$site/.installed"
fi
# The CPU is what is measured: no CUDA device for torch, and DeepSpeed's CPU accelerator.
export PYTHONPATH="$site:$PWD" CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1
lscpu > "${OUT:-/tmp}/lscpu.txt"
python3 -c "import torch, ray, deepspeed, transformers, datasets; print('torch', torch.__version__, 'ray', ray.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__)"
exec "$@"
