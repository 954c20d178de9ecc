# kvstore-lazy: `make demo` and `make test` set everything up on a fresh machine (see README.md).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the compiled kernels and fast path (_fast.so beside protocol/_fast.c), built in place by the editable install
# (setup.py); rebuilt when kernels.c or _fast.c changes
KERNELS := kvstore_lazy/store/_kernels.so
# matplotlib for the benchmark plots (the [bench] extra), pinned; numpy held at requirements.txt's pin
BENCH_STAMP := $(VENV)/.bench-installed
# ruff and mypy for `make lint`, pinned
LINT_STAMP := $(VENV)/.lint-installed

.PHONY: venv system-deps k8s-deps test-cluster test-docker test test-unit test-integration test-server-python demo \
        bench bench-quick bench-scale patch unpatch clean lint

venv: $(STAMP) $(KERNELS)

$(STAMP): requirements.txt pyproject.toml setup.py
	@command -v ss >/dev/null && command -v cc >/dev/null && $(PY_HEADERS) 2>/dev/null || $(MAKE) system-deps
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -c "import mxnet, numpy, zmq; print('mxnet', mxnet.__version__, 'numpy', numpy.__version__, 'zmq', zmq.zmq_version())"
	touch $(STAMP)

$(KERNELS): $(wildcard kvstore_lazy/store/kernels*.[ch] kvstore_lazy/protocol/_fast*.[ch] \
            kvstore_lazy/transport/_zmqmsg*.[ch]) $(STAMP)
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m kvstore_lazy.store.kernels
	touch $(KERNELS)

$(BENCH_STAMP): requirements-bench.txt $(STAMP)
	$(PY) -m pip install --quiet -r requirements-bench.txt -c requirements.txt
	touch $(BENCH_STAMP)

test: venv lint docs $(BENCH_STAMP) k8s-deps
	$(PY) -m pytest -q -p no:cacheprovider -m "not cluster" tests
	$(MAKE) test-server-python

# MkDocs and the Material theme for `make docs`, pinned exactly in docs/requirements.txt
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): docs/requirements.txt $(STAMP)
	$(PY) -m pip install --quiet -r docs/requirements.txt
	touch $(DOCS_STAMP)

# The manual (docs/ and mkdocs.yml) into build/site; --strict: a broken link or anchor, a page missing
# from the nav or a nav entry without its page fails the build (`make test` runs it). Open build/site/index.html.
.PHONY: docs
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -f mkdocs.yml -d build/site

$(LINT_STAMP): requirements-lint.txt $(STAMP)
	$(PY) -m pip install --quiet -r requirements-lint.txt
	touch $(LINT_STAMP)

# ruff over the whole tree and mypy over protocol, store, server and promexport, as configured in pyproject.toml
# ([tool.ruff], [tool.mypy]); `make test` runs it before the tests; quick to re-run alone (a few seconds).
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The server as `pip install kvstore-lazy` gives it, on another Python: the wheel built from this tree (compiled
# kernels inside), installed with SERVER_NUMPY and requirements-server.txt alone into a venv of SERVER_PYTHON
# (CPython 3.13, numpy 2). With no C compiler on PATH and no source tree on sys.path, it runs the server-side unit
# tests (the test files that do not import mxnet: SERVER_TESTS), then, under .venv, tests/test_server_python.py
# (arithmetic bit for bit against MXNet and numpy 1.23) and real jobs whose servers run on SERVER_PYTHON
# (KVSTORE_LAZY_SERVER_PYTHON, see tests/cluster.py) against stock scheduler and workers; last, checks that nothing
# wrote into its site-packages.
# Another Python or numpy: make test-server-python SERVER_PYTHON=.../python3.12 SERVER_NUMPY=numpy==1.26.4
PYENV_DIR     := $(or $(shell pyenv root 2>/dev/null),$(PYENV_ROOT),$(HOME)/.pyenv)
SERVER_PYTHON ?= $(lastword $(sort $(wildcard $(PYENV_DIR)/versions/3.13.*/bin/python3.13)))
SERVER_VENV   := .venv-server
SERVER_NUMPY  ?= numpy==2.5.5
SERVER_TESTS  := tests/test_protocol.py tests/test_fast.py tests/test_rows.py tests/test_segments.py tests/test_kernels.py tests/test_compression.py \
                 tests/test_disk_runs.py tests/test_disk_runs_background.py \
                 tests/test_cli.py tests/test_layers.py tests/test_promexport.py \
                 tests/test_recovery.py tests/test_launch.py tests/test_transport.py
SERVER_JOBS   := tests/test_server_python.py \
                 "tests/test_training_integration.py::test_training_matches_stock[gluon-sync-2s-adam-partitioned]" \
                 "tests/test_training_integration.py::test_training_matches_stock[module-async-1s-sgd]" \
                 "tests/test_dense_integration.py::test_dense_matches_stock[sync-2s-2bit]" \
                 "tests/test_lazy_integration.py::test_lazy_init_ships_no_rows_and_stores_only_trained[2servers-partitioned]" \
                 tests/test_lazy_integration.py::test_same_initial_rows_with_1_and_2_servers_and_shuffled_pulls \
                 tests/test_metrics_integration.py
NO_CC_PATH    := $$($(CURDIR)/$(PY) $(CURDIR)/tests/path_without_compilers.py $(CURDIR)/build/no-cc-bin)

test-server-python: venv
	@test -x "$(SERVER_PYTHON)" || { echo "need CPython 3.13: set SERVER_PYTHON (pyenv install 3.13)"; exit 1; }
	rm -rf build/wheel $(SERVER_VENV)
	$(PY) -m pip wheel --quiet --no-deps -w build/wheel .
	$(SERVER_PYTHON) -m venv $(SERVER_VENV)
	$(SERVER_VENV)/bin/python -m pip install --quiet -r requirements-server.txt "$(SERVER_NUMPY)" \
	    build/wheel/kvstore_lazy-*.whl
	$(SERVER_VENV)/bin/python -I -c "import sys, numpy, zmq; print('server venv: Python', sys.version.split()[0], \
	    'numpy', numpy.__version__, 'zmq', zmq.zmq_version())"
	touch $(SERVER_VENV)/.installed
	cd $(SERVER_VENV) && env -u CC PATH=$(NO_CC_PATH) bin/python -P -m pytest -q -p no:cacheprovider \
	    -m "not integration" $(addprefix $(CURDIR)/,$(SERVER_TESTS))
	env -u CC PATH=$(NO_CC_PATH) KVSTORE_LAZY_SERVER_PYTHON=$(CURDIR)/$(SERVER_VENV)/bin/python \
	    $(PY) -m pytest -q -p no:cacheprovider -rs $(SERVER_JOBS)
	@changed="$$(find $(SERVER_VENV)/lib -newer $(SERVER_VENV)/.installed | head -5)"; \
	  test -z "$$changed" || { echo "the server wrote into its site-packages: $$changed"; exit 1; }

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
# (and Python's headers, python3-dev, for the extension module protocol/_fast.c, if $(PYTHON) lacks them)
PY_HEADERS := $(PYTHON) -c "import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))"
system-deps:
	@command -v ip >/dev/null && command -v ss >/dev/null && command -v setpriv >/dev/null && command -v cc >/dev/null \
	  && $(PY_HEADERS) 2>/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux gcc libc6-dev \
	    python3-dev; }

test-unit: venv k8s-deps
	$(PY) -m pytest -q -p no:cacheprovider -m "not integration" tests

test-integration: venv
	$(PY) -m pytest -q -p no:cacheprovider -m integration tests

demo: venv
	$(PY) scripts/demo.py

bench: venv $(BENCH_STAMP)
	$(PY) scripts/bench.py

patch: venv
	$(PY) scripts/patch_mxnet.py apply

unpatch: venv
	$(PY) scripts/patch_mxnet.py revert

clean:
	rm -rf $(VENV) $(SERVER_VENV) build *.egg-info $(KERNELS)

bench-quick: venv $(BENCH_STAMP)
	$(PY) scripts/bench.py --quick

# Opt-in, not part of `make bench`: issue 29's scale run (scripts/bench.py, scenario disk-scale): 300M rows of a
# (2^40, 8) key under a 1 GiB budget by default, ~30 minutes and ~28 GB of disk under bench-results/ (deleted after).
# Smaller: make bench-scale ROWS=20000000 BUDGET=1GiB
bench-scale: venv $(BENCH_STAMP)
	$(PY) scripts/bench.py --scenarios disk-scale $(if $(ROWS),--rows $(ROWS)) $(if $(BUDGET),--budget $(BUDGET))

# Opt-in, not part of `make test`: a real Prometheus (Debian's package, installed if missing) scrapes a small real
# job on 127.0.0.1 and every query of docker/grafana/kvstore-lazy.json must return data (scripts/prometheus_check.py).
.PHONY: check-dashboard
check-dashboard: venv
	timeout 900 $(PY) scripts/prometheus_check.py
