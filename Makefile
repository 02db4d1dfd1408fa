# The two commands: `make demo` and `make test`. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install etcd postgresql spin systemd iproute2 demo test lint proto bench models clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check --upgrade pip
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev,spark,postgres]'
	touch $@

# etcd from Debian's etcd-server package, only when no etcd binary is on PATH.
etcd:
	@command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || { \
	  echo "installing etcd-server from Debian"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq etcd-server >/dev/null; }

# PostgreSQL from Debian (the consumer's PostgresStore tests and bench start their own server),
# only when no PostgreSQL server binaries are installed.
postgresql:
	@command -v postgres >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || { \
	  echo "installing postgresql from Debian"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq postgresql >/dev/null; }

# spin (Debian) and a C compiler for the verifier it generates: the LogPlayer model's checks
# (models/check.py, tests/logplayer/test_models.py), only when either is missing.
spin:
	@{ command -v spin >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1; } || { \
	  echo "installing spin and gcc from Debian"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq spin gcc >/dev/null; }

# systemd-analyze (Debian's systemd) verifies deploy/systemd's units (tests/test_deploy.py), only when missing.
systemd:
	@command -v systemd-analyze >/dev/null 2>&1 || { \
	  echo "installing systemd (for systemd-analyze) from Debian"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq systemd >/dev/null; }

# ip (Debian's iproute2) makes the network-namespace hosts of the tests (tests/support/netns.py).
iproute2:
	@command -v ip >/dev/null 2>&1 || { \
	  echo "installing iproute2 (for ip netns) from Debian"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq iproute2 >/dev/null; }

install: $(STAMP) etcd postgresql spin systemd iproute2

demo: install
	$(VENV)/bin/tidings demo

# The tests start hundreds of Python processes (brokers, consumers, the CLI, Spark workers): each
# reads the project's bytecode instead of compiling it again (~0.15 s a broker), whatever
# PYTHONDONTWRITEBYTECODE the environment sets (__pycache__ is ignored by git).
test: lint
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -q -p no:cacheprovider

# Ruff, and mypy strict on src/tidings (pyproject's [tool.mypy]; every `type: ignore` says why).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check src tests bench examples models
	$(VENV)/bin/mypy

# Regenerate the committed protobuf code (tests/protocol/test_protocol.py checks it is current).
proto: $(STAMP)
	$(PY) -m tidings.protocol.generate

bench: install
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[bench]'
	$(PY) bench/append.py
	$(PY) bench/messages.py
	bash -o pipefail -c '$(PY) bench/logplayer.py | tee bench/results/logplayer-last.jsonl'
	bash -o pipefail -c '$(PY) bench/logplayer.py --sweep rate --txns 300 | tee -a bench/results/logplayer-last.jsonl'
	$(PY) bench/logplayer.py --plot bench/results/logplayer-last.jsonl

# The LogPlayer model at larger bounds than `make test` checks (tens of minutes).
models: install
	$(PY) models/check.py --size large

clean:
	rm -rf $(VENV) build *.egg-info
