# dspark-worker on one NVIDIA GPU (docs/operations.md, "Run it").
#
#   docker build -t dspark-worker:0.1.0 .
#   docker run --rm --gpus '"device=0"' -p 7600:7600 -p 7601:7601 \
#       -v /srv/models:/checkpoints:ro -v /etc/dspark/auth-secret:/run/secrets/dspark-auth:ro \
#       dspark-worker:0.1.0 \
#       --checkpoint /checkpoints/dspark-qwen3-8b --target-checkpoint /checkpoints/qwen3-8b \
#       --auth-secret-file /run/secrets/dspark-auth
#
# Arguments after the image name are appended to the ENTRYPOINT's flags, and a later flag wins,
# so `--listen` / `--metrics-listen` can still be overridden. With no --checkpoint the worker
# serves its embedded tiny reference drafter (for a smoke test, not for production).
#
# torch: the same version CI tests (.ci/run). The default index is PyPI, whose Linux x86-64
# wheel of torch 2.13.0 is built for CUDA 13.0 and needs an NVIDIA driver >= 580. For an older
# driver pick a PyTorch wheel index built for a CUDA the driver supports (check which CUDA
# builds exist for TORCH_VERSION), for example
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 ...
# (and .../whl/cpu for a CPU-only image).
FROM python:3.11.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple

# HOME and the caches (CUDA's JIT cache, Triton's, torch's) under /tmp: the one writable path
# when the root filesystem is read-only (Kubernetes readOnlyRootFilesystem mounts an emptyDir
# there; with `docker run --read-only` add `--tmpfs /tmp`). The port file goes there too.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache

# tini as PID 1: until the drafter is loaded the worker has no SIGTERM handler, and PID 1
# ignores signals it does not handle, so without an init `docker stop` / a pod deletion during
# a slow checkpoint load would wait for the kill timeout. tini forwards signals and reaps.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 dspark \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/dspark \
        --shell /usr/sbin/nologin dspark \
    && python -m venv /opt/venv

# The heavy layer first, so that source changes do not reinstall torch and its CUDA libraries.
# torch and the nvidia-* wheels it depends on are the image's only CUDA: the base image has none.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"

WORKDIR /opt/dspark
# The rest of the worker's dependencies, read from pyproject.toml (core + the worker extra), so
# this list cannot drift from the package's. torch is left out of it: pip never installs a
# second torch (and a second set of CUDA wheels) over the one above; `pip check` below fails the
# build if TORCH_VERSION is not the version the worker extra pins.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
reqs = p['dependencies'] + p['optional-dependencies']['worker']; \
print('\n'.join(r for r in reqs if not r.startswith('torch')))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY protocol ./protocol
COPY dspark_worker ./dspark_worker
COPY dspark_client ./dspark_client
# --no-deps: everything it needs is installed above. dspark-client comes along for debugging
# from inside the container (`dspark-client --endpoint tcp://127.0.0.1:7600 stats`).
RUN pip install --no-deps . \
    && pip check \
    && mkdir -p /checkpoints \
    && dspark-worker --version

USER 10001:10001
WORKDIR /home/dspark
# Checkpoints come from the host or a persistent volume, mounted read-only (never baked in).
VOLUME ["/checkpoints"]
# 7600: the draft protocol (TCP); 7601: HTTP /metrics, /healthz (ready), /livez (alive).
EXPOSE 7600 7601
# Ready = /healthz answers 200: the drafter is loaded and warm, not draining. The check reads the
# port file the worker writes once ready (the ENTRYPOINT's --port-file), so it asks the metrics
# address the worker really listens on, whatever --metrics-listen says (with --metrics-listen
# none it only checks that the draft port accepts connections): do not override --port-file.
# -I: no current directory or PYTHON* variables on the import path. A big checkpoint can take
# minutes to load: the start period covers it.
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-I", "-m", "dspark_worker.healthcheck", "/tmp/dspark-ports.json"]
# Listen on every interface of the container; publish the ports only where engines can reach
# them, and configure --auth-secret-file on any shared network (docs/operations.md, "Auth").
ENTRYPOINT ["/usr/bin/tini", "--", "dspark-worker", "--listen=0.0.0.0:7600", "--metrics-listen=0.0.0.0:7601", "--port-file=/tmp/dspark-ports.json"]
