# One image for every kvmesh service; the command picks the service (kvmesh ingest|indexer|router, or an
# operator command such as provision, route, status).
#   builder  python:3.11-slim + uv: the locked dependencies and the library and services, built as wheels
#            into /app/.venv (uv sync --frozen --no-dev --no-editable --compile-bytecode) from pyproject.toml
#            and uv.lock
#   sim      adds kvmesh-tools (the simulated engines) for docker-compose.yml's sim-0/sim-1 (`target: sim`)
#   service  the default (last) target: python:3.11-slim with that venv only (no uv, no build tools, no
#            tools/ sources, no simulator or benchmark code), run as the non-root user kvmesh (uid 1000)
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
RUN pip install --no-cache-dir "uv>=0.5,<1"
ENV UV_PYTHON_DOWNLOADS=never UV_PYTHON=/usr/local/bin/python3 UV_PROJECT_ENVIRONMENT=/app/.venv \
    UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy
WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY shared ./shared
COPY services ./services
# uv reads every workspace member's pyproject.toml; the tools' sources stay out of the service image.
COPY tools/pyproject.toml ./tools/pyproject.toml
# --compile-bytecode: the services run as uid 1000 and cannot write __pycache__ into the venv; without it every
# start compiles numba's, numpy's and nats-py's sources again (about a second of CPU per process).
RUN uv sync --frozen --no-dev --no-editable --compile-bytecode \
    --package kvmesh-ingest --package kvmesh-indexer --package kvmesh-router

FROM builder AS sim-builder
COPY tools ./tools
RUN uv sync --frozen --no-dev --no-editable --compile-bytecode --package kvmesh-tools

FROM ${PYTHON_IMAGE} AS runtime
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvmesh
ENV PATH="/app/.venv/bin:$PATH" PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/app/numba-cache
WORKDIR /app

FROM runtime AS sim
COPY --from=sim-builder /app/.venv /app/.venv
# The index's compiled kernels, built once into the image (any uid may add to the cache).
RUN python -c "from kvmesh.core.tables import compile_all; compile_all()" && chmod -R a+rwX "$NUMBA_CACHE_DIR"
USER kvmesh
ENTRYPOINT ["kvmesh"]
CMD ["sim", "--help"]

FROM runtime AS service
COPY --from=builder /app/.venv /app/.venv
RUN python -c "from kvmesh.core.tables import compile_all; compile_all()" && chmod -R a+rwX "$NUMBA_CACHE_DIR"
USER kvmesh
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
