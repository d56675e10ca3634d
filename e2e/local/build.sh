#!/usr/bin/env bash
# Builds the local control plane's binaries from Go modules into a cache outside the
# repository, and reuses them when they are already there:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  (k8s.io/kubernetes)
#   etcd (go.etcd.io/etcd/server/v3), kwok (sigs.k8s.io/kwok), helm (helm.sh/helm/v3),
#   the LeaderWorkerSet controller (sigs.k8s.io/lws) with its CRDs and webhook manifests,
#   a minimal OpenTelemetry Collector (gomod/otelcol: OTLP receiver, file exporter)
#   kstatus (gomod/kstatus: sigs.k8s.io/cli-utils pkg/kstatus's verdict on one object)
# Prints the bin directory on stdout; progress goes to stderr.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
# Versions live in versions.env so the Python harness reads the same pins.
# shellcheck source=versions.env
source "$here/versions.env"

cache="${PDCLUSTER_CACHE:-$HOME/.cache/pdcluster}"
bin="$cache/bin/k8s-v$KUBERNETES_VERSION-etcd-v$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION"
mkdir -p "$bin"
# One build at a time: a test that needs a binary may call this while `make deps` runs.
exec 9>"$bin/.build.lock"
flock 9
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--buildvcs=false}"
log() { echo "build.sh: $*" >&2; }

minor="${KUBERNETES_VERSION#*.}"; minor="${minor%%.*}"
need_k8s=0
for b in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  [ -x "$bin/$b" ] || need_k8s=1
done
if [ "$need_k8s" = 1 ]; then
  log "building Kubernetes v$KUBERNETES_VERSION (a few minutes on 2 cores)"
  (cd "$here/gomod/kubernetes" && go build -trimpath -o "$bin/" -ldflags "-s -w \
      -X k8s.io/component-base/version.gitVersion=v$KUBERNETES_VERSION \
      -X k8s.io/component-base/version.gitMajor=1 \
      -X k8s.io/component-base/version.gitMinor=$minor \
      -X k8s.io/component-base/version.gitTreeState=clean \
      -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl) >&2
fi

if [ ! -x "$bin/etcd" ]; then
  log "building etcd v$ETCD_VERSION"
  (cd "$here/gomod/etcd" && go build -trimpath -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3) >&2
fi

if [ ! -x "$bin/kwok" ]; then
  log "building kwok $KWOK_VERSION"
  GOBIN="$bin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" >&2
fi

if [ ! -x "$bin/helm" ]; then
  log "building helm $HELM_VERSION"
  # Helm 3 takes its default Kubernetes version for offline rendering from ldflags.
  GOBIN="$bin" go install -trimpath -ldflags "-s -w \
      -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
      -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
      -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor \
      -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 \
      -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
fi

# The LeaderWorkerSet controller and what it ships beside its code (CRDs, webhooks).
lws="$bin/lws-$LWS_VERSION"
if [ ! -x "$lws/lws-controller" ]; then
  log "building the LeaderWorkerSet controller $LWS_VERSION"
  mkdir -p "$lws.tmp"
  (cd "$here/gomod/lws" && go build -trimpath -ldflags "-s -w" -o "$lws.tmp/lws-controller" sigs.k8s.io/lws/cmd) >&2
  src="$(cd "$here/gomod/lws" && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)"
  cp "$src"/config/crd/bases/*.yaml "$src/config/webhook/manifests.yaml" "$lws.tmp/"
  chmod -R u+w "$lws.tmp"
  rm -rf "$lws" && mv "$lws.tmp" "$lws"
fi

# A minimal OpenTelemetry Collector (OTLP in, OTLP JSON lines to a file) for tests that
# check the traces a component sends; its factories are in gomod/otelcol/main.go.
otelcol="$bin/otelcol-$OTELCOL_VERSION"
if [ ! -x "$otelcol/otelcol" ]; then
  log "building the OpenTelemetry Collector $OTELCOL_VERSION"
  mkdir -p "$otelcol.tmp"
  (cd "$here/gomod/otelcol" && go build -trimpath -ldflags "-s -w -X main.version=$OTELCOL_VERSION" \
    -o "$otelcol.tmp/otelcol" .) >&2
  rm -rf "$otelcol" && mv "$otelcol.tmp" "$otelcol"
fi

# kstatus's verdict on an object (Current, InProgress, Failed ...), as Flux and
# kstatus-based tools compute it, for tests of the PDCluster's conditions.
kstatus="$bin/kstatus-$KSTATUS_VERSION"
if [ ! -x "$kstatus/kstatus" ]; then
  log "building kstatus (sigs.k8s.io/cli-utils $KSTATUS_VERSION)"
  mkdir -p "$kstatus.tmp"
  (cd "$here/gomod/kstatus" && go build -trimpath -ldflags "-s -w" -o "$kstatus.tmp/kstatus" .) >&2
  rm -rf "$kstatus" && mv "$kstatus.tmp" "$kstatus"
fi

# kwok v0.8 ships no default stages; the harness writes its own, but keep the
# upstream ones next to the binary for reference when debugging.
echo "$bin"
