#!/usr/bin/env bash
# Builds .whl/ (git-ignored) in the repository root: what a lent device machine lacks to run the
# benchmarks. Run here, where pip reaches the registry, from the repository root, inside the
# project's venv (its versions are the ones carried; DeepSpeed's wheel is built with its torch):
#
#     bash benchmarks/device/bundle.sh [python version, default 3.12]
#
# Why each part (benchmarks/device/README.md has the whole procedure):
# - The device image (its package list: the device tool's KINDS.md) has torch, numpy, pyarrow,
#   tokenizers, safetensors, accelerate, peft and most of their needs, but no Ray, DeepSpeed or
#   datasets, and an older transformers; it has no registry.
# - A call carries at most 64 MiB with the working tree. Ray's wheel alone is ~79 MB, so it goes
#   as a tar.xz without what a benchmark never imports (Java jars, RLlib, Serve, LLM, the
#   dashboard's web client): ~29 MB.
# - DeepSpeed publishes only an sdist: a pure-Python wheel is built here with no ops
#   (DS_BUILD_OPS=0; the runs use torch_adam and need no JIT build).
set -euo pipefail
py="${1:-3.12}"
out=.whl
[ -f pyproject.toml ] && [ -d raytrain_cpu ] || { echo "run from the repository root" >&2; exit 2; }
python -c "import torch, ray, deepspeed" || { echo "activate the project's venv first" >&2; exit 2; }
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

pins() { python -c "import importlib.metadata as m, sys; print(*(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" "$@"; }

# Missing from the device image (or too old there), at this venv's versions.
CARRIED=(transformers datasets dill multiprocess hjson pydantic pydantic-core annotated-types
    typing-inspection jsonschema jsonschema-specifications referencing rpds-py tensorboardx tzdata
    httpx2 httpcore2 truststore regex py-spy)
platforms=()
for n in 17 27 28 2014_x86_64 1_x86_64; do
    case $n in *_x86_64) platforms+=(--platform "manylinux$n") ;; *) platforms+=(--platform "manylinux_2_${n}_x86_64") ;; esac
done
python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" -d "$out" $(pins "${CARRIED[@]}")

python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" -d "$tmp/ray" "$(pins ray)"
mkdir -p "$tmp/ray/site"
unzip -q "$tmp"/ray/ray-*.whl -d "$tmp/ray/site"  # unzip keeps the execute bits of raylet and gcs_server
rm -rf "$tmp"/ray/site/ray/{jars,rllib,serve,llm,dashboard/client}
tar -C "$tmp/ray/site" -cJf "$out/ray-stripped.tar.xz" .

python -m pip download -q --no-deps --no-binary=:all: -d "$tmp/ds" "$(pins deepspeed)"
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$tmp"/ds/deepspeed-*.tar.gz

du -sh "$out"
total=$(($(du -sk "$out" | cut -f1) + $(git ls-files -z | du -ck --files0-from=- | tail -1 | cut -f1)))
echo "with the tracked tree: $((total / 1024)) MiB of the 64 MiB a call carries"
[ "$total" -lt $((62 * 1024)) ] || { echo "too large to carry" >&2; exit 1; }
