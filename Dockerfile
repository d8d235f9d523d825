# The carryover router (and its simulator): locked dependencies, no build tools at run time,
# a non-root user.
FROM python:3.11-slim AS build
RUN pip install --no-cache-dir uv
WORKDIR /app
# Bytecode written at build time: a router starts without compiling its modules.
ENV UV_COMPILE_BYTECODE=1
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project
COPY state ./state
COPY router ./router
COPY bench ./bench
COPY carryover ./carryover
RUN uv sync --frozen --no-dev

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /app carryover
COPY --from=build --chown=carryover:carryover /app /app
ENV PATH="/app/.venv/bin:$PATH" PYTHONUNBUFFERED=1
USER carryover
WORKDIR /app
EXPOSE 8000
ENTRYPOINT ["carryover"]
CMD ["serve", "--host=0.0.0.0", "--port=8000"]
