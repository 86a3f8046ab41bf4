# One image for every kvmesh service; the command picks the service (kvmesh ingest|indexer|router|sim).
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir "uv>=0.5,<1"
COPY pyproject.toml uv.lock ./
COPY shared ./shared
COPY services ./services
RUN UV_PYTHON_DOWNLOADS=never uv sync --frozen --all-packages --no-dev
ENV PATH="/app/.venv/bin:$PATH"
ENTRYPOINT ["kvmesh"]
