# The GPU worker image: CUDA 13.0 (devel: FlashInfer compiles its kernels with nvcc on first use),
# Python 3.12, torch 2.11.0+cu130, FlashInfer and NIXL (`pip install '.[engine,gpu,nixl]'`).
# Also the image that writes the tiny model (it needs torch), for every pod of a release.
#
#   docker build -f docker/worker.Dockerfile -t REGISTRY/splitserve-worker:0.1.0 .
#
# The tag is the package version (pyproject.toml) and the chart's appVersion.
FROM ghcr.io/astral-sh/uv:0.13.8 AS uv

FROM nvidia/cuda:13.0.1-devel-ubuntu24.04
# the host compiler nvcc drives when FlashInfer JIT-compiles a kernel
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:13.2.0-7ubuntu1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=uv /uv /usr/local/bin/uv
# one pinned CPython for every build of the image (the tiny model's tokenizer is trained on its
# standard library, so it must not drift with the distribution's Python)
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_NO_CACHE=1 UV_LINK_MODE=copy
RUN uv python install 3.12.12 \
 && uv venv --python 3.12.12 /opt/splitserve
# torch for CUDA 13.0 first, from PyTorch's index; the project's extras then find it installed
RUN uv pip install --python /opt/splitserve/bin/python \
      --index-url https://download.pytorch.org/whl/cu130 torch==2.11.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY perf/ perf/
COPY runtime/ runtime/
COPY kvstore/ kvstore/
COPY engine/ engine/
COPY prefill_worker/ prefill_worker/
COPY decode_worker/ decode_worker/
COPY router/ router/
COPY frontend/ frontend/
COPY planner/ planner/
COPY pools/ pools/
COPY sim/ sim/
COPY splitserve/ splitserve/
RUN uv pip install --python /opt/splitserve/bin/python '.[engine,gpu,nixl]' \
 && rm -rf /src
WORKDIR /
RUN useradd --no-log-init -l -u 10001 -M -d /cache -s /usr/sbin/nologin splitserve
ENV PATH=/opt/splitserve/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/cache \
    SPLITSERVE_CACHE=/cache/splitserve
USER 10001:10001
# worker gRPC and /metrics (the chart's defaults)
EXPOSE 50061 9090
ENTRYPOINT ["splitserve"]
CMD ["--help"]
