# kvstore-lazy: `make demo` and `make test` set everything up on a fresh machine (see README.md).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv system-deps k8s-deps test-cluster test-docker test test-unit test-integration demo bench bench-quick patch unpatch clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@command -v ss >/dev/null && command -v cc >/dev/null || $(MAKE) system-deps
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -c "import mxnet, numpy, zmq; print('mxnet', mxnet.__version__, 'numpy', numpy.__version__, 'zmq', zmq.zmq_version())"
	$(PY) -m kvstore_lazy.store.kernels
	touch $(STAMP)

test: venv k8s-deps
	$(PY) -m pytest -q -p no:cacheprovider -m "not cluster" tests

# What tests/test_k8s_manifests.py renders and validates docker/k8s/ with: Debian's kubectl (kubernetes-client, for
# `kubectl kustomize`), unpacked into .venv/k8s (not installed: it would clash with another kubectl package), and
# kubernetes-validate (the Kubernetes OpenAPI schemas, offline) into the venv.
K8S_DIR   := $(VENV)/k8s
K8S_STAMP := $(K8S_DIR)/.installed
k8s-deps: $(K8S_STAMP)

$(K8S_STAMP): $(STAMP) docker/k8s/requirements-test.txt
	$(PY) -m pip install --quiet -r docker/k8s/requirements-test.txt
	@command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || { echo "k8s-deps: needs apt-get and dpkg-deb (Debian)"; exit 1; }
	rm -rf $(K8S_DIR) && mkdir -p $(K8S_DIR)
	cd $(K8S_DIR) && { apt-get download -qq kubernetes-client 2>/dev/null || { apt-get update -qq && apt-get download -qq kubernetes-client; }; }
	dpkg-deb -x $(K8S_DIR)/kubernetes-client_*.deb $(K8S_DIR) && rm -f $(K8S_DIR)/*.deb
	$(K8S_DIR)/usr/bin/kubectl version --client
	touch $@

# Jobs across network-namespace hosts (scripts/netns_cluster.sh) and the fault scenarios; needs root and iproute2.
test-cluster: venv system-deps
	$(PY) -m pytest -q -p no:cacheprovider -m cluster tests/test_cluster.py tests/test_k8s_cluster.py

# Docker: starts its own dockerd (in a network namespace), builds the image from an offline debootstrap base,
# runs docker/docker-compose.yml (scheduler, 2 lazy servers, 2 workers) to completion and checks the checkpoint.
test-docker:
	bash scripts/docker_test.sh

# iproute2 (ip, ss), util-linux (setpriv), and a C compiler for kvstore_lazy/store/kernels.c
system-deps:
	@command -v ip >/dev/null && command -v ss >/dev/null && command -v setpriv >/dev/null && command -v cc >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux gcc libc6-dev; }

test-unit: venv k8s-deps
	$(PY) -m pytest -q -p no:cacheprovider -m "not integration" tests

test-integration: venv
	$(PY) -m pytest -q -p no:cacheprovider -m integration tests

demo: venv
	$(PY) scripts/demo.py

bench: venv
	$(PY) scripts/bench.py

patch: venv
	$(PY) scripts/patch_mxnet.py apply

unpatch: venv
	$(PY) scripts/patch_mxnet.py revert

clean:
	rm -rf $(VENV) build *.egg-info

bench-quick: venv
	$(PY) scripts/bench.py --quick
