# kvstore-lazy: `make demo` and `make test` set everything up on a fresh machine (see README.md).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the compiled kernels, built in place by the editable install (setup.py); rebuilt when kernels.c changes
KERNELS := kvstore_lazy/store/_kernels.so

.PHONY: venv system-deps test-cluster test-docker test test-unit test-integration demo bench bench-quick patch unpatch clean

venv: $(STAMP) $(KERNELS)

$(STAMP): requirements.txt pyproject.toml setup.py
	@command -v ss >/dev/null && command -v cc >/dev/null || $(MAKE) system-deps
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -c "import mxnet, numpy, zmq; print('mxnet', mxnet.__version__, 'numpy', numpy.__version__, 'zmq', zmq.zmq_version())"
	touch $(STAMP)

$(KERNELS): kvstore_lazy/store/kernels.c $(STAMP)
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m kvstore_lazy.store.kernels
	touch $(KERNELS)

test: venv
	$(PY) -m pytest -q -p no:cacheprovider -m "not cluster" tests

# Jobs across network-namespace hosts (scripts/netns_cluster.sh) and the fault scenarios; needs root and iproute2.
test-cluster: venv system-deps
	$(PY) -m pytest -q -p no:cacheprovider -m cluster tests/test_cluster.py

# Docker: starts its own dockerd (in a network namespace), builds the image from an offline debootstrap base,
# runs docker/docker-compose.yml (scheduler, 2 lazy servers, 2 workers) to completion and checks the checkpoint.
test-docker:
	bash scripts/docker_test.sh

# iproute2 (ip, ss), util-linux (setpriv), and a C compiler for kvstore_lazy/store/kernels.c
system-deps:
	@command -v ip >/dev/null && command -v ss >/dev/null && command -v setpriv >/dev/null && command -v cc >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 util-linux gcc libc6-dev; }

test-unit: venv
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
	rm -rf $(VENV) build *.egg-info $(KERNELS)

bench-quick: venv
	$(PY) scripts/bench.py --quick
