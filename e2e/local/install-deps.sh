#!/usr/bin/env bash
# Debian packages the local cluster needs: Prometheus (real, scraping the pods),
# libibverbs1 (mooncake_master links it even for TCP), util-linux's unshare and gcc
# (the pod runner's private mounts and bind shim). Go comes with the machine.
set -euo pipefail
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
ldconfig -p | grep -q libibverbs.so.1 || missing+=(libibverbs1)
command -v unshare >/dev/null || missing+=(util-linux)
command -v gcc >/dev/null || missing+=(gcc libc6-dev)
command -v go >/dev/null || { echo "install-deps.sh: Go 1.26 is required (go.dev/doc/install)" >&2; exit 1; }
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
