# Soft Memory Box — build, demo and test entry points.
# Every target bootstraps what it needs, idempotently.

PY_SYS   ?= /usr/bin/python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
PIP      := $(VENV)/bin/pip
STAMP    := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/smb/v1/*.proto)
PROTO_OUT := smb_protocol/_proto/smb/v1
# etcd's v3 API: stubs generated from the .proto files golang-etcd-server-dev ships
ETCD_PROTO_OUT := smb_protocol/_proto/etcd
# base tools; the C compiler and Python's headers (pip builds the C parts named in
# setup.py into the tree); rdma-core, the rxe provider and pyverbs
# (RDMA data plane, `smb doctor`); perftest (reference for the rdma benchmark); qemu,
# a Debian kernel with rdma_rxe and busybox (the Soft-RoCE VM that runs the rdma
# tier); systemd (unit verification); slurmctld/slurmd (the Slurm batch script runs
# under a one-node Slurm in the tests); python3-apt (Ansible's apt module, for the playbook test); etcd (the replicated
# controller store; the tests start their own etcd on free loopback ports, so the
# package's own service, where systemd starts it, is not in their way); etcd's .proto
# files (golang-etcd-server-dev: the controller's etcd client is generated from them)
APT_PKGS := python3-venv python3-dev gcc libc6-dev iproute2 procps \
            rdma-core ibverbs-providers ibverbs-utils python3-pyverbs perftest \
            qemu-system-x86 linux-image-amd64 busybox-static systemd \
            slurmctld slurmd slurm-client python3-apt etcd-server etcd-client \
            golang-etcd-server-dev

.PHONY: all deps apt venv proto demo lint api-docs test test-host test-unit test-integration test-rdma bench bench-rdma bench-cluster clean

all: proto

apt:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml setup.py smb_protocol/_native.c smb_protocol/_native.h smb_protocol/_lowat.h \
          smb_client/transports/answers.c $(wildcard smb_server/memserver/native/*.[ch]) | apt
	@test -x $(PY) || $(PY_SYS) -m venv --system-site-packages $(VENV)
	$(PIP) install -q --disable-pip-version-check -e '.[dev,torch,otel]'
	@touch $(STAMP)

venv: $(STAMP)

$(PROTO_OUT)/.stamp: $(PROTO_SRC) $(STAMP)
	@mkdir -p $(PROTO_OUT)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=smb_protocol/_proto --pyi_out=smb_protocol/_proto \
	    --grpc_python_out=smb_protocol/_proto $(PROTO_SRC)
	$(PY) tools/fix_proto_imports.py smb_protocol/_proto
	@touch $@

$(ETCD_PROTO_OUT)/.stamp: tools/etcd_protos.py tools/fix_proto_imports.py $(STAMP)
	$(PY) tools/etcd_protos.py smb_protocol/_proto
	$(PY) tools/fix_proto_imports.py smb_protocol/_proto
	@touch $@

proto: $(PROTO_OUT)/.stamp $(ETCD_PROTO_OUT)/.stamp

deps: venv proto

demo: deps
	$(PY) examples/demo.py
	$(PY) examples/train_digits.py --workers 4 --min-accuracy 0.95

# static checks: ruff for the whole project, mypy --strict for the client library
lint: deps
	$(PY) -m ruff check .
	$(PY) -m mypy

# the client library's API reference, from its docstrings (pdoc), in build/api/index.html;
# fails on any warning (tests/unit/test_api_docs.py builds it too)
api-docs: deps
	$(PY) tools/api_docs.py build/api

# static checks, the host suite, then the rdma tier inside the Soft-RoCE VM (fails
# loudly if the VM cannot start)
test: lint test-host test-rdma

# the host suite on TEST_WORKERS processes (pytest-xdist), each taking whole test files
# (a file's tests share module fixtures and run in order); TEST_WORKERS=0 runs it in this
# process. Serially it keeps a 2-core host only 50-60 % busy (waits on daemons and links)
TEST_WORKERS ?= 2
test-host: deps
	$(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) tests

# the VM emulates its CPUs (no KVM): the tier takes 15-25 minutes on a 2-core host, up to
# twice that on a slower one
test-rdma: deps
	SMB_VM_BENCH=0 SMB_VM_TIMEOUT=$${SMB_VM_TIMEOUT:-3000} tests/rdma/run_vm.sh

test-unit: deps
	$(PY) -m pytest -q tests/unit

test-integration: deps
	$(PY) -m pytest -q tests/integration

bench: deps
	$(PY) bench/dataplane.py
	$(PY) bench/notify.py
	$(PY) bench/replication.py
	$(PY) bench/persistence.py
	$(PY) bench/tracing.py

bench-rdma: deps
	SMB_VM_BENCH=1 tests/rdma/run_vm.sh

# a cluster on one machine: memory servers and workers in network namespaces with capped
# links (root; see docs/benchmarks.md)
bench-cluster: deps
	$(PY) -m bench.cluster

clean:
	rm -rf $(VENV) smb_protocol/_proto *.egg-info .pytest_cache build/api
