# The carryover router: locked dependencies, installed as a package (no source tree at run
# time), a non-root user. EXTRAS=bench builds the simulator's image (compose's sim profile).
FROM python:3.11-slim AS build
RUN pip install --no-cache-dir uv
WORKDIR /app
ARG EXTRAS=""
# Bytecode written at build time: a router starts without compiling its modules.
ENV UV_COMPILE_BYTECODE=1
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project ${EXTRAS:+--extra $EXTRAS}
COPY state ./state
COPY router ./router
COPY bench ./bench
COPY carryover ./carryover
RUN uv sync --frozen --no-dev --no-editable ${EXTRAS:+--extra $EXTRAS}

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /app carryover
COPY --from=build --chown=carryover:carryover /app/.venv /app/.venv
ENV PATH="/app/.venv/bin:$PATH" PYTHONUNBUFFERED=1
USER carryover
WORKDIR /app
EXPOSE 8000
ENTRYPOINT ["carryover"]
CMD ["serve", "--host=0.0.0.0", "--port=8000"]
