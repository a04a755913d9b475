# qiao's container image, CPU (default) or CUDA; docs/deploy.md walks through it.
#
#   docker build -t qiao:0.1.0-cpu .
#   docker build -t qiao:0.1.0-cuda --build-arg VARIANT=cuda .
#
# Two stages per variant: `build` makes the wheel, installs it with its server dependencies into
# a virtual environment at /opt/qiao/venv and compiles the C++ CPU kernels into /opt/qiao/cache;
# `runtime` copies /opt/qiao as it is (same paths, so the kernel cache's key still matches) and
# carries no compiler. The kernels are built with -march=native, and their cache is keyed on the
# CPU's instruction-set extensions: build the image on the machine type it will run on. Elsewhere
# qiao logs "CPU kernels unavailable" once and serves with the PyTorch reference ops.

ARG VARIANT=cpu

# --- the Python each variant runs on --------------------------------------------------------
FROM python:3.11.11-slim-bookworm AS python-cpu

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS python-cuda
# Ubuntu's Python 3.12 (the only one its packages offer); versions follow the pinned image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

# --- what both stages share -------------------------------------------------------------------
# (a stage of this file, named by the variant: hadolint cannot see that it is pinned above)
# hadolint ignore=DL3006
FROM python-${VARIANT} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/qiao/venv \
    PATH=/opt/qiao/venv/bin:${PATH} \
    QIAO_CACHE_DIR=/opt/qiao/cache

# --- build: the wheel, the environment, the kernels --------------------------------------------
FROM base AS build
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# The PyTorch wheel index: the CPU build, or for CUDA the build matching the base image's CUDA.
ARG TORCH_CUDA=cu128
ARG TORCH_INDEX_URL=""
# g++ compiles the CPU kernels; Ubuntu's Python needs its headers apart (python:*-slim ships
# them). Versions follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && if ! python3 -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then \
        apt-get install -y --no-install-recommends python3-dev; fi \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/qiao/venv \
    && echo "torch==${TORCH_VERSION}" > /opt/qiao/constraints.txt \
    && if [ "${VARIANT}" = cuda ]; then build="${TORCH_CUDA}"; else build=cpu; fi \
    && pip install --no-cache-dir \
        --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${build}}" \
        "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY qiao ./qiao
# The constraint keeps the torch build installed above (a dependency must not swap it for
# PyPI's). The kernel source is copied beside the installed package when the wheel lacks it:
# the kernel cache is keyed on that file, and a start reads it to find its build.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /tmp/wheels . \
    && pip install --no-cache-dir --constraint /opt/qiao/constraints.txt \
        "$(find /tmp/wheels -name 'qiao-*.whl')[server,redis]" \
    && cp -rn qiao/kernels/csrc \
        "$(python -c 'import os, qiao.kernels as k; print(os.path.dirname(k.__file__))')/" \
    && rm -rf /tmp/wheels
# Build the kernels now and fail the image build if they did not build; then drop the build's
# object files (a start imports only the library and its COMPLETE record).
RUN python -m qiao.kernels \
    && python -c "import sys; from qiao.kernels import cpu_ops; sys.exit(cpu_ops() is None)" \
    && rm -rf /opt/qiao/cache/kernels/*/work

# --- runtime -----------------------------------------------------------------------------------
FROM base AS runtime
# Extra packages for the runtime, e.g. "g++" ("g++ python3-dev" for CUDA) so that a machine
# whose CPU differs from the builder's builds its own kernels at first start (into a writable
# QIAO_CACHE_DIR). Empty by default: the image carries no compiler.
ARG RUNTIME_APT_PACKAGES=""
# tini: PID 1 that reaps orphans and passes SIGTERM to qiao alone (qiao stops its engine
# processes itself, after draining). libgomp1: the kernels' OpenMP runtime.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini libgomp1 ${RUNTIME_APT_PACKAGES} \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 qiao \
    && useradd --system --uid 10001 --gid qiao --home-dir /home/qiao --create-home \
        --shell /usr/sbin/nologin qiao \
    && mkdir -p /models /var/lib/qiao \
    && chown qiao:qiao /var/lib/qiao
COPY --from=build /opt/qiao /opt/qiao
# The cache stays root's: a start only reads it. Other libraries' caches go to /tmp (an emptyDir
# under Kubernetes' readOnlyRootFilesystem).
# Binding all interfaces needs an API key (QIAO_API_KEY, QIAO_API_KEY_FILE or QIAO_KEYS_FILE):
# without one qiao refuses to start, as it does outside a container.
ENV HOME=/home/qiao \
    XDG_CACHE_HOME=/tmp/.cache \
    QIAO_HOST=0.0.0.0 \
    QIAO_PORT=8000 \
    QIAO_GRPC_PORT=8001 \
    QIAO_DATA_DIR=/var/lib/qiao
VOLUME ["/models", "/var/lib/qiao"]
# HTTP (OpenAI, KServe v2 HTTP, /metrics, health) and KServe v2 gRPC.
EXPOSE 8000 8001
USER 10001:10001
WORKDIR /home/qiao
# qiao drains on SIGTERM: readiness 503, no new work, in-flight requests get up to
# --drain-timeout (30 s); give `docker stop` more than that (docker stop -t 45).
STOPSIGNAL SIGTERM
# /health/live answers once the models are loaded and HTTP is up (no API key needed).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/live' % os.environ.get('QIAO_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["tini", "--", "qiao"]
CMD ["serve"]
