# One image for every kvmesh service; the command picks the service (kvmesh ingest|indexer|router).
# The default (last) target holds the library and the services only: no simulator, benchmarks, trace data,
# nats-server binary or kvmesh-tools. The `sim` target adds kvmesh-tools for docker-compose.yml's simulated
# workers (`docker build --target sim .`).
FROM python:3.11-slim AS base
WORKDIR /app
RUN pip install --no-cache-dir "uv>=0.5,<1"
ENV UV_PYTHON_DOWNLOADS=never PATH="/app/.venv/bin:$PATH"
COPY pyproject.toml uv.lock ./
COPY shared ./shared
COPY services ./services
# uv needs every workspace member's pyproject.toml to read the workspace; the tools' sources stay out.
COPY tools/pyproject.toml ./tools/pyproject.toml
ENTRYPOINT ["kvmesh"]

FROM base AS sim
COPY tools ./tools
RUN uv sync --frozen --no-dev --package kvmesh-tools

FROM base AS service
RUN uv sync --frozen --no-dev --package kvmesh-ingest --package kvmesh-indexer --package kvmesh-router
