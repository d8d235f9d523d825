# The README's two commands are `make demo` and `make test`; both bootstrap what they need.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# uv from PATH, else the one pip installs into this python (bootstrap does that when missing).
UV ?= $(shell command -v uv 2>/dev/null || echo python3 -m uv)
PYTEST_ARGS ?=

.PHONY: help bootstrap redis-server prometheus valgrind vllm-env demo test test-fast test-vllm test-render-diff lint bench

help: ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

bootstrap: ## install uv if missing and the locked environment
	@$(UV) --version >/dev/null 2>&1 || { echo "installing uv"; python3 -m pip install --quiet uv; }
	@$(UV) sync --frozen --quiet --extra bench --compile-bytecode
	@# Bytecode for our own modules too: where PYTHONDONTWRITEBYTECODE is set, every process
	@# (each test's router, simulator and engine helper) would otherwise compile ~600 modules
	@# from source at start, about 3 s of CPU each on this machine (docs/test-suite.md).
	@$(UV) run --frozen --no-sync python -m compileall -q -j 0 carryover router state bench tests >/dev/null

redis-server: ## make sure a redis-server binary exists (tests start their own servers)
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server with apt"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null); \
	  else \
	    echo "redis-server is missing: install it (Debian/Ubuntu: sudo apt-get install redis-server)"; exit 1; \
	  fi; }

prometheus: ## make sure a prometheus binary exists (the report and dashboard tests run one)
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing prometheus with apt"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null); \
	  else \
	    echo "prometheus is missing: install it (Debian/Ubuntu: sudo apt-get install prometheus)"; exit 1; \
	  fi; }

valgrind: ## make sure valgrind exists (the instructions benchmark and its test count with it)
	@command -v valgrind >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing valgrind with apt"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null); \
	  else \
	    echo "valgrind is missing: install it (Debian/Ubuntu: sudo apt-get install valgrind)"; exit 1; \
	  fi; }

vllm-env: bootstrap ## build (once) the vLLM CPU environment, LMCache over it, and the tiny model
	@$(UV) run python -c "from bench.real.launch import ensure_model; print(ensure_model())"
	@$(UV) run python -c "from bench.real.lmcache import ensure_lmcache_env; print(ensure_lmcache_env())"

demo: bootstrap ## simulated P/D engines + router + in-process state: a turn-by-turn TTFT report
	@$(UV) run carryover demo

# The tiers without vLLM wait on processes and sockets far more than they compute: they run on
# TEST_WORKERS pytest-xdist workers, a module per worker. Then one session without workers runs
# what cannot be split (tests marked serial) and the real tier, alone: its engines run at a
# low priority and would starve beside anything else (docs/test-suite.md). pytest exits 5 when
# it selected nothing: fine for one of the two sessions, not for both.
TEST_WORKERS ?= 3
PYTEST = $(UV) run pytest
define two_sessions
	@$(PYTEST) -m "not real and not serial" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); \
	  a=$$?; [ $$a = 0 ] || [ $$a = 5 ] || exit $$a; \
	  $(PYTEST) -m "$(1)" $(PYTEST_ARGS); b=$$?; [ $$b = 0 ] || { [ $$b = 5 ] && [ $$a = 0 ]; } || exit $$b
endef

test: bootstrap redis-server prometheus valgrind vllm-env ## the whole suite (with the real-vLLM tier)
	$(call two_sessions,serial or real)

test-fast: bootstrap redis-server prometheus valgrind ## everything but the real-vLLM tier
	$(call two_sessions,serial)

test-vllm: bootstrap redis-server vllm-env ## the real-vLLM tier alone
	@$(UV) run pytest -m real $(PYTEST_ARGS)

test-render-diff: bootstrap vllm-env ## the router's rendering against vLLM's own code alone (no engine)
	@$(UV) run pytest -m real tests/real/test_render_vllm.py $(PYTEST_ARGS)

lint: bootstrap ## ruff and mypy
	@$(UV) run ruff check . && $(UV) run ruff format --check . && $(UV) run mypy

bench: bootstrap ## state-layer micro-benchmark
	@$(UV) run python -m carryover.bench.state_bench
