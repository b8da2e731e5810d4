# Soft Memory Box — build, demo and test entry points.
# Every target bootstraps what it needs, idempotently.

PY_SYS   ?= /usr/bin/python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(VENV)/bin/pip
STAMP    := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/smb/v1/*.proto)
PROTO_OUT := smb_client/_proto/smb/v1
APT_PKGS := python3-venv python3-dev iproute2 procps

.PHONY: all deps apt venv proto demo test test-unit test-integration bench clean

all: proto

apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml | apt
	@test -x $(PY) || $(PY_SYS) -m venv --system-site-packages $(VENV)
	$(PIP) install -q --disable-pip-version-check -e '.[dev,torch]'
	@touch $(STAMP)

venv: $(STAMP)

$(PROTO_OUT)/.stamp: $(PROTO_SRC) $(STAMP)
	@mkdir -p $(PROTO_OUT)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=smb_client/_proto --pyi_out=smb_client/_proto \
	    --grpc_python_out=smb_client/_proto $(PROTO_SRC)
	$(PY) tools/fix_proto_imports.py smb_client/_proto
	@touch $@

proto: $(PROTO_OUT)/.stamp

deps: venv proto

demo: deps
	$(PY) examples/demo.py

test: deps
	$(PY) -m pytest -q tests

test-unit: deps
	$(PY) -m pytest -q tests/unit

test-integration: deps
	$(PY) -m pytest -q tests/integration

bench: deps
	$(PY) bench/dataplane.py

clean:
	rm -rf $(VENV) smb_client/_proto *.egg-info .pytest_cache
