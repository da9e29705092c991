# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TSTAMP := $(VENV)/.installed-test
FSTAMP := $(VENV)/.built-fused
CSTAMP := $(VENV)/.built-kvcodec
ARGS   ?=

.PHONY: install install-test fused codec sysdeps serve test test-fast proto bench clean

# The daemon alone: no torch, transformers or vLLM.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "need Python >= 3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $@

# What the tests need on top: torch (CPU build), transformers, UCX, and the real vLLM, in one
# pip resolution with the project itself.
$(TSTAMP): pyproject.toml scripts/install_vllm.sh
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "need Python >= 3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	KVSTORE_PIP_EXTRA="-e .[test,torch,ucx,hf]" ./scripts/install_vllm.sh $(PY)
	touch $(STAMP) $@

# The UCX receive that hashes as it copies (transport/_fused.c) for the test environment's ucxx;
# needs a C compiler and xxhash.h (sysdeps). Without it the UCX receiver hashes payloads once
# they have landed: as correct, slower over shared memory.
$(FSTAMP): transport/_fused.c scripts/build_fused.sh $(TSTAMP) | sysdeps
	./scripts/build_fused.sh $(PY)
	touch $@

# The C block codec (kvstore/_kvcodec.c) for kvstore.codec and the CPU caches' block copies
# (tiers/_kvcopy.c); need only a C compiler. Without them the codec tests measure the slower
# zstd codec and decode the C codec's payloads in numpy, and CPU engines copy with torch.
$(CSTAMP): kvstore/_kvcodec.c tiers/_kvcopy.c scripts/build_kvcodec.sh $(TSTAMP)
	./scripts/build_kvcodec.sh $(PY)
	touch $@

install: $(STAMP)
install-test: $(TSTAMP)
fused: $(FSTAMP)
codec: $(CSTAMP)

# System tools the tests use: fio (same-run NVMe reference), etcd (the cluster tests), redis-server
# (the cluster directory on a Redis cluster) and
# xxhash.h (the fused UCX receive's build). Installed only when missing, in one apt-get run.
sysdeps:
	@missing=""; command -v fio >/dev/null 2>&1 || missing=" fio"; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	echo '#include <xxhash.h>' | $${CC:-cc} -E -x c - >/dev/null 2>&1 || missing="$$missing libxxhash-dev"; \
	if [ -n "$$missing" ]; then \
	  { command -v apt-get >/dev/null 2>&1 && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } || \
	  echo "warning: could not install$$missing; without fio the NVMe benchmarks fall back to a raw O_DIRECT reference; without etcd the cluster tests are skipped; without redis-server the Redis directory tests are skipped; without libxxhash-dev the fused UCX receive cannot be built"; \
	fi

serve: $(STAMP)
	$(VENV)/bin/kvstore serve $(ARGS)

# Two workers, each taking whole modules (a module's daemons, etcd or vLLM engine are started
# once, in one worker): about half of a serial run's time waits on processes, not on a CPU.
# xdist hands out the modules with the most tests first. Handing out the longest first
# (--no-loadscope-reorder with a longest-first order) measured slower in a fresh clone (tests
# 10:59 against 9:46): two vLLM modules then start their engines together on two cores.
# Byte-code writing on (PYTHONDONTWRITEBYTECODE empty): a module the install's import check did
# not compile is compiled once, by the first test process that imports it, not at every import.
TEST_WORKERS ?= 2
test: $(TSTAMP) sysdeps $(FSTAMP) $(CSTAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

proto: $(TSTAMP)
	./scripts/gen_proto.sh

bench: $(STAMP)
	$(VENV)/bin/kvstore bench store $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
