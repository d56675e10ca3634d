"""Names shared by the operator, the router, the simulators and the chart."""

from typing import Final

from pdcluster import __version__

GROUP: Final = "pdcluster.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "PDCluster"
PLURAL: Final = "pdclusters"
SINGULAR: Final = "pdcluster"
SHORT_NAMES: Final = ["pdc"]
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# One per engine role when autoscaling.mode is `external`: HPA/KEDA scale it through /scale.
SCALER_KIND: Final = "PDRoleScaler"
SCALER_PLURAL: Final = "pdrolescalers"
SCALER_SINGULAR: Final = "pdrolescaler"
SCALER_SHORT_NAMES: Final = ["pdrs"]
SCALER_CRD_NAME: Final = f"{SCALER_PLURAL}.{GROUP}"

FIELD_MANAGER: Final = "pdcluster-operator"

# Labels on every child object and pod; the router, Prometheus relabelling and the
# autoscaler's PromQL all select on these.
LABEL_CLUSTER: Final = f"{GROUP}/cluster"
LABEL_ROLE: Final = f"{GROUP}/role"
# On a flexible pool's pods: the role the routers make the engine act as now (prefill,
# decode; absent while it is not ready). Prometheus relabels it to `role`, so the law reads
# per-role engine series from kv_both engines as from fixed roles (flexible.acting_roles).
LABEL_ACTING_ROLE: Final = f"{GROUP}/acting-role"
# Set by the Job controller on the pods of a Job (Kubernetes 1.27+).
LABEL_JOB_NAME: Final = "batch.kubernetes.io/job-name"
# On engine pods: what prefill and decode must share to exchange KV (rollout.py).
LABEL_KV_REVISION: Final = f"{GROUP}/kv-revision"
# On each child: a hash of what the operator rendered for it (drift.stamp).
ANNOTATION_RENDERED: Final = f"{GROUP}/rendered-hash"
# LeaderWorkerSet (roles spanning nodes): its API and the pod label its webhook sets,
# "0" on each group's leader (sigs.k8s.io/lws api/leaderworkerset/v1).
LWS_API_VERSION: Final = "leaderworkerset.x-k8s.io/v1"
LABEL_LWS_WORKER_INDEX: Final = "leaderworkerset.sigs.k8s.io/worker-index"
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_VERSION: Final = "app.kubernetes.io/version"
APP_NAME: Final = "pdcluster"
MANAGED_BY: Final = "pdcluster-operator"

ANNOTATION_SCRAPE: Final = "prometheus.io/scrape"
ANNOTATION_SCRAPE_PORT: Final = "prometheus.io/port"
ANNOTATION_SCRAPE_PATH: Final = "prometheus.io/path"

ROLE_PREFILL: Final = "prefill"
ROLE_DECODE: Final = "decode"
ROLE_COLOCATED: Final = "colocated"  # colocated: prefill and decode on one engine, no KV hand-off
# flexible: engines of one configuration (kv_both) that the router makes prefill or decode per request
ROLE_FLEXIBLE: Final = "flexible"
# In the roles ConfigMap the operator writes and the routers watch: how many flexible
# engines act as prefill.
KEY_PREFILL_ENGINES: Final = "prefillEngines"
ROLE_ROUTER: Final = "router"
ROLE_MOONCAKE_MASTER: Final = "mooncake-master"
ROLE_MOONCAKE_STORE: Final = "mooncake-store"
ENGINE_ROLES: Final = (ROLE_PREFILL, ROLE_DECODE)

# Kubernetes names are at most 63 characters; the longest child suffix is
# "-mooncake-master" (16) and a StatefulSet's controller-revision-hash label adds
# "-<10 chars>" to "<name>-prefill", so 40 leaves room for both.
MAX_CLUSTER_NAME_LEN: Final = 40

# Ports of the programs this project ships.
ENGINE_PORT: Final = 8000
ROUTER_PORT: Final = 8000
BOOTSTRAP_PORT: Final = 8998
# vLLM's KV events publisher (config/kv_events.py: endpoint "tcp://*:5557"); DP rank r
# publishes on this port + r.
KV_EVENTS_PORT: Final = 5557
# Its replay socket (replay_endpoint), where a subscriber asks for batches it missed;
# also offset by the DP rank, so far enough above the events port for 100 ranks.
KV_EVENTS_REPLAY_PORT: Final = 5657

# Repositories without a registry host: users point them at their own registry.
IMAGE_REPOSITORY: Final = "pdcluster"
DEFAULT_ROUTER_IMAGE: Final = f"{IMAGE_REPOSITORY}/router:{__version__}"
DEFAULT_MOONCAKE_IMAGE: Final = f"{IMAGE_REPOSITORY}/mooncake:{__version__}"  # images/mooncake
