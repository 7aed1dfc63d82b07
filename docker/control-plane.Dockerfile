# The control-plane image: frontend, router, planner and the `splitserve` CLI (`pip install .` of
# the base package, plus the `k8s` extra for the planner's Kubernetes connector). No torch, no CUDA.
#
#   docker build -f docker/control-plane.Dockerfile -t REGISTRY/splitserve-control-plane:0.1.0 .
#
# The tag is the package version (pyproject.toml) and the chart's appVersion.
FROM python:3.12.12-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
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
RUN python -m venv /opt/splitserve \
 && /opt/splitserve/bin/pip install --no-cache-dir '.[k8s]'

FROM python:3.12.12-slim-bookworm
COPY --from=build /opt/splitserve /opt/splitserve
RUN useradd --no-log-init -l -u 10001 -M -d /cache -s /usr/sbin/nologin splitserve
ENV PATH=/opt/splitserve/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/cache \
    SPLITSERVE_CACHE=/cache/splitserve
USER 10001:10001
# frontend HTTP and gRPC, the planner's admin API
EXPOSE 8000 50051 50052
ENTRYPOINT ["splitserve"]
CMD ["--help"]
