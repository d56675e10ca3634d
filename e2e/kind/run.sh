#!/usr/bin/env bash
# The operator on a kind cluster, with the images built from this repository:
#   create the cluster, build and load the images, advertise fake GPUs, start Prometheus,
#   install the operator from the Helm chart, apply the simulated PDCluster, replay a
#   trace through the router and watch the operator rebalance prefill:decode.
#
#   e2e/kind/run.sh           set up (or reuse) the cluster and run the demo
#   e2e/kind/run.sh down      delete the cluster
#
# Needs docker (with BuildKit), kind, kubectl, helm and the project's venv (make deps).
# KIND_CLUSTER names the cluster; PDCLUSTER_TRACES the traces folder (default ../shared/traces).
set -euo pipefail

cd "$(dirname "$0")/../.."
CLUSTER=${KIND_CLUSTER:-pdcluster}
TRACES=${PDCLUSTER_TRACES:-../shared/traces}
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
IMAGES=(operator router engine-sim mooncake)
NAMESPACE=demo
OPERATOR_NAMESPACE=pdcluster-system
EXAMPLE=examples/pdcluster-sim.yaml
CHART=charts/pdcluster-operator
GPUS_PER_NODE=4
WORK=$(mktemp -d)
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

step() { printf '\n==> %s\n' "$*"; }
need() { command -v "$1" >/dev/null || { echo "run.sh: $1 is required" >&2; exit 1; }; }

if [ "${1:-}" = down ]; then
  need kind
  kind delete cluster --name "$CLUSTER"
  exit 0
fi
for tool in docker kind kubectl helm; do need "$tool"; done
[ -x .venv/bin/python ] || { echo "run.sh: run 'make deps' first (the demo's replay runs in .venv)" >&2; exit 1; }
[ -d "$TRACES" ] || { echo "run.sh: traces folder $TRACES not found; set PDCLUSTER_TRACES" >&2; exit 1; }

step "kind cluster $CLUSTER"
if ! kind get clusters | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --config e2e/kind/kind-config.yaml --wait 180s
fi
export KUBECONFIG="$WORK/kubeconfig"
kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG"

step "images pdcluster/{operator,router,engine-sim,mooncake}:$VERSION (build context: the repository)"
refs=()
for image in "${IMAGES[@]}"; do
  docker build -q -f "images/$image/Dockerfile" -t "pdcluster/$image:$VERSION" .
  refs+=("pdcluster/$image:$VERSION")
done
kind load docker-image --name "$CLUSTER" "${refs[@]}"

step "fake GPUs: nvidia.com/gpu=$GPUS_PER_NODE on nodes labelled nvidia.com/gpu.present=true"
# Extended resources are advertised by patching node status (Kubernetes docs: "Advertise
# Extended Resources for a Node"); the engine simulator needs no device behind them.
for node in $(kubectl get nodes -l nvidia.com/gpu.present=true -o name); do
  kubectl patch "$node" --subresource=status --type=json \
    -p "[{\"op\": \"add\", \"path\": \"/status/capacity/nvidia.com~1gpu\", \"value\": \"$GPUS_PER_NODE\"}]" >/dev/null
done

step "Prometheus (monitoring/prometheus)"
kubectl apply -f e2e/kind/prometheus.yaml >/dev/null
kubectl rollout status -n monitoring deployment/prometheus --timeout=180s

step "operator from the Helm chart into $OPERATOR_NAMESPACE"
helm upgrade --install pdcluster-operator "$CHART" --namespace "$OPERATOR_NAMESPACE" --create-namespace \
  --set image.tag="$VERSION" --set prometheusUrl=http://prometheus.monitoring:9090 \
  --set nodeSelector.pdcluster\\.io/pool=cpu --wait --timeout 180s

step "PDCluster from $EXAMPLE into namespace $NAMESPACE"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl delete -n "$NAMESPACE" -f "$EXAMPLE" --ignore-not-found --wait >/dev/null  # start at 1:1
kubectl apply -n "$NAMESPACE" -f "$EXAMPLE"
kubectl wait -n "$NAMESPACE" pdcluster/demo --for=condition=Ready --timeout=300s
kubectl get pdc,pods -n "$NAMESPACE" -o wide

step "trace replay through the router, live view of the operator's decisions"
kubectl port-forward -n "$NAMESPACE" svc/demo-router 18000:8000 >/dev/null &
PIDS+=($!)
kubectl port-forward -n monitoring svc/prometheus 19090:9090 >/dev/null &
PIDS+=($!)
sleep 2
PDCLUSTER_TRACES="$TRACES" .venv/bin/python e2e/local/demo.py watch --kubeconfig "$KUBECONFIG" \
  --router-url http://127.0.0.1:18000 --prometheus-url http://127.0.0.1:19090 --namespace "$NAMESPACE" --pdcluster demo

step "what the operator did"
kubectl describe pdcluster demo -n "$NAMESPACE" | sed -n '/^Events:/,$p'
kubectl get pdc -n "$NAMESPACE"
printf '\nThe cluster stays up: kubectl --context kind-%s get pdc -A; delete it with e2e/kind/run.sh down\n' "$CLUSTER"
