# kernelmode: `make run` sets up what serving needs and serves; `make test` sets up everything
# (test tools, agent frameworks too) and runs every test. Both are idempotent: the second time
# they only check stamps.

PYTHON ?= python3
# The kernel environment uses the system Python: it must be readable by the unprivileged
# sandbox users (a Python under /root or a 0700 home would not be).
KERNEL_PYTHON ?= /usr/bin/python3
VENV := .venv
KVENV := .kernel-venv
PIP_FLAGS ?= -q --disable-pip-version-check
ARGS ?=

.PHONY: setup setup-run run test lint docs docs-gen bench bench-quick bench-goals clean docker-setup docker-test setup-cluster bench-cluster k8s-check wheelhouse

# Everything: the service, test tools, agent-framework adapters, the kernel environment.
setup: .stamp-system .stamp-system-test $(VENV)/.stamp $(KVENV)/.stamp .stamp-cluster
# The Enterprise Gateway rig (tests/cluster): sshd, nftables, EG's own .eg-venv and launcher.
setup-cluster: .stamp-cluster
.stamp-cluster: scripts/setup-cluster.sh tests/cluster/eg-requirements.txt .stamp-system-test
	bash scripts/setup-cluster.sh
	@touch $@

# What `kernelmode serve` needs and nothing more.
setup-run: .stamp-system $(VENV)/.stamp-run $(KVENV)/.stamp

.stamp-system: scripts/install-system-deps.sh
	bash scripts/install-system-deps.sh
	@touch $@

.stamp-system-test: scripts/install-system-deps.sh
	bash scripts/install-system-deps.sh --test
	@touch $@

$(VENV)/.stamp-run: pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) -e .
	@touch $@

$(VENV)/.stamp: pyproject.toml $(VENV)/.stamp-run
	$(VENV)/bin/pip install $(PIP_FLAGS) -e '.[test,docs,langchain,crewai]'
	@touch $@

# The same code as `kernelmode setup` (kernelmode/setup_env.py): a venv of KERNEL_PYTHON with
# kernel-image/requirements.txt and the kernels' IPython config (kernel-image/ipython_kernel_config.json,
# into $(KVENV)/etc/ipython), readable by the sandbox uids; it writes $(KVENV)/.stamp.
# CONFIG (default: ./kernelmode.yaml if there is one): its kernel.extra_requirements go in too.
CONFIG ?= $(wildcard kernelmode.yaml)
$(KVENV)/.stamp: kernel-image/requirements.txt kernel-image/ipython_kernel_config.json .stamp-system $(CONFIG) | $(VENV)/.stamp-run
	$(VENV)/bin/kernelmode setup --quiet --kernel-env $(KVENV) --python $(KERNEL_PYTHON) \
		--requirements kernel-image/requirements.txt $(if $(CONFIG),--config $(CONFIG))
	@touch $@

run: setup-run
	$(VENV)/bin/kernelmode serve $(ARGS)

# The documentation site on http://127.0.0.1:8000 (mkdocs.yml; the pages generated from the settings
# models and bench/RESULTS.md are rewritten first).
docs: setup docs-gen
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

docs-gen: $(VENV)/.stamp
	$(VENV)/bin/python scripts/gen_docs.py

lint: setup
	$(VENV)/bin/ruff check kernelmode tests bench examples notebooks
	$(VENV)/bin/mypy kernelmode

# Everything against bubblewrap, then the sandbox suites against Docker (the engine and the
# kernel image are installed or built on first use, cached after).
test: setup lint
	$(VENV)/bin/pytest -ra $(ARGS)
	$(MAKE) docker-test

DOCKER_SUITES ?= tests/security tests/sandbox tests/integration/test_sessions.py \
	tests/integration/test_lifecycle.py tests/integration/test_files.py \
	tests/integration/test_recovery.py tests/integration/test_checkpoints.py \
	tests/integration/test_hibernation.py tests/integration/test_burst.py \
	tests/integration/test_kernel_start_death.py
docker-test: setup docker-setup
	KM_TEST_BACKEND=docker $(VENV)/bin/pytest -ra $(DOCKER_SUITES)

bench: setup
	$(VENV)/bin/python bench/roundtrip.py
	$(VENV)/bin/python bench/scale.py
	$(VENV)/bin/python bench/backends.py
	$(VENV)/bin/python bench/recovery.py
	$(VENV)/bin/python bench/load.py
	$(VENV)/bin/python bench/mcp_startup.py
	$(VENV)/bin/python bench/tool_search.py

# Kernels on two namespace nodes through Enterprise Gateway (root; tests/cluster's rig).
bench-cluster: setup
	$(VENV)/bin/python bench/cluster.py

bench-quick: setup
	$(VENV)/bin/python bench/roundtrip.py --quick --no-write
	$(VENV)/bin/python bench/scale.py --quick --no-write
	$(VENV)/bin/python bench/backends.py --quick --no-write
	$(VENV)/bin/python bench/recovery.py --quick --no-write
	$(VENV)/bin/python bench/load.py --quick --no-write
	$(VENV)/bin/python bench/mcp_startup.py --quick --no-write

# The performance goals (issue 18) in one table, met / not met: quick runs of the benchmarks; fails
# (exit 1) when a goal is not met. Ratios are against direct kernels tuned like kernelmode's.
bench-goals: setup
	$(VENV)/bin/python bench/goals.py --quick

# The Docker sandbox backend: engine, daemon (no container network), base and kernel images.
# Idempotent; a no-op in well under a second when all is there (scripts/docker-setup.sh).
docker-setup:
	bash scripts/docker-setup.sh

# Every dependency of the service image as a wheel in wheelhouse/ (scripts/wheelhouse.sh), made
# where an index is reachable; then the image builds with none: build arg WHEELHOUSE=wheelhouse.
wheelhouse:
	bash scripts/wheelhouse.sh

# The Kubernetes images (deploy/kubernetes/images), built on the local kernel image, and checked as
# their pods run them; no cluster needed, not part of `make test` (the builds fetch from PyPI).
k8s-check: setup
	bash scripts/k8s-images.sh

clean:
	rm -rf $(VENV) $(KVENV) .eg-venv .kernelmode .stamp-system .stamp-cluster
