# edge-gateway: `make demo` sets everything up and runs the broker on its embedded default;
# `make test` sets everything up and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
APT_PACKAGES := mosquitto mosquitto-clients

.PHONY: demo test lint venv deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test,fast]'
	touch $@

venv: $(VENV)/.installed

# Debian packages the tests use (real mosquitto_pub/mosquitto_sub clients, Mosquitto as a peer).
deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

demo: venv
	$(BIN)/edge-gateway serve

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check gateway tests

test: venv deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) var .pytest_cache
