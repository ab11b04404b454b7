# edge-gateway: `make demo` sets everything up and runs the broker on its embedded default, fed by a simulated
# sensor board through firmware-bridge;
# `make test` sets everything up and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
APT_PACKAGES := mosquitto mosquitto-clients systemd chromium rauc squashfs-tools u-boot-qemu u-boot-tools \
	qemu-system-arm dosfstools mtools fdisk valgrind

.PHONY: demo test test-cluster test-cross lint venv compiler deps clean bench cloadgen soak fuzz image image-test image-powercut image-deps bundle image-update-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The install compiles gateway/mqtt, gateway/broker and the store's row encodings (gateway/store/records.py) with
# mypyc (setup.py; EDGE_GATEWAY_COMPILE=1 puts mypy into the build environment: docs/compiled.md): a C compiler and Python's headers are installed first when missing and apt-get can
# (root); without them the install is the pure-Python code. Any edit of one of those .py files reinstalls
# (until then gateway/native.py runs the edited .py files, not stale C).
# A build of sources compiled before (the image's wheel, a reinstall) copies them from build/core-cache (setup.py).
# bokeh-sampledata: the simulator's real data (NERACOOS buoy B01 sea-surface temperature), without pandas/numpy
# pysparkplug: the Sparkplug B host application of the tests (an implementation other than the bridge's); its
# metadata pins paho-mqtt<2 for its MQTT client, which the tests do not use (they use only its payload codec)
$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py build_backend/edge_gateway_build.py \
    $(wildcard gateway/mqtt/*.py) $(wildcard gateway/broker/*.py) gateway/store/records.py \
    gateway/store/open_batch.py gateway/store/applier.py gateway/server/protocol.py
	@$(MAKE) --no-print-directory compiler
	EDGE_GATEWAY_COMPILE=1 $(BIN)/pip install -q -e '.[test,fast,pipeline,deploy]'
	@$(BIN)/edge-gateway version --verbose | sed -n 's/^core: /the MQTT codec and broker core run /p'
	$(BIN)/pip install -q --no-deps 'bokeh-sampledata==2026.1'
	$(BIN)/pip install -q --no-deps 'pysparkplug==0.6.1'
	touch $@

venv: $(VENV)/.installed

# What mypyc's C needs: gcc and the C library's headers, and Python.h for $(PYTHON) (Debian's python3-dev when it is
# Debian's Python; a Python built from source has its own). Nothing is installed without root or apt-get.
COMPILER_APT_PACKAGES := gcc libc6-dev
compiler:
	@missing=""; for p in $(COMPILER_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
	  || missing="$$missing python3-dev"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages (the compiled MQTT codec and broker core):$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null \
	      || echo "could not install$$missing: the MQTT codec and broker core will be pure Python"; \
	  else echo "missing$$missing (not root or no apt-get): the MQTT codec and broker core will be pure Python"; fi; \
	fi

# Debian packages the tests use (real mosquitto_pub/mosquitto_sub clients, Mosquitto as a peer; rauc and
# squashfs-tools make and check the update bundles of tests/test_update_bundles.py; U-Boot for qemu's arm64 virt
# board, mkimage and qemu-system-aarch64 run the arm64 image's A/B boot script in tests/test_uboot_ab.py (with
# dosfstools, mtools and fdisk for its small disk); chromium renders the
# pipeline report headless and runs mqtt.js over WebSockets, which npm installs into that test's temp dir: npm is
# installed when missing, unless a nodejs without it is there (NodeSource's bundles npm; Debian's conflicts with it),
# and the browser test skips without it).
deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@command -v java >/dev/null 2>&1 || { echo "installing a Java runtime (Spark, for the pipeline tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless >/dev/null; }
	@command -v npm >/dev/null 2>&1 || { echo "installing npm (mqtt.js for tests/test_websockets_browser.py)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null \
	  || echo "npm could not be installed: tests/test_websockets_browser.py will skip"; }

# broker + a simulated sensor board on a pty + firmware-bridge, printing the readings as they arrive; Ctrl-C stops all
# demo/cloud.py adds a stand-in cloud broker on 127.0.0.1:1884 and the gateway's upstream link to it ([cloud], [link])
# SPARKPLUG=1: firmware-bridge is also a Sparkplug B Edge Node (spBv1.0/plant-demo/..., decoded on the screen)
demo: venv
	$(BIN)/python demo/cloud.py -- $(BIN)/python firmware-bridge/demo.py $(if $(SPARKPLUG),--sparkplug)

# ruff's lint rules ([tool.ruff] in pyproject.toml) and the architecture contracts (import-linter: layers, the sans-I/O
# core, no cycles). Formatting is not checked: the code is wrapped by hand at 120 columns, which `ruff format` would
# rewrite in 50 files.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The test files run on TEST_WORKERS pytest-xdist workers (each file on one worker, its tests in order): most tests
# wait on brokers, sockets and qemu rather than compute, so 2 workers on 2 cores halve the wall time.
# TEST_WORKERS=0 runs everything in one process.
# The suite runs on the compiled MQTT codec, broker core and store rows (--core compiled fails at once if the install
# has none); then the in-process codec, topic, core, limits, protocol-glue and store-name tests and the fuzzer's short
# run again on their .py files (EDGE_GATEWAY_PURE=1, gateway/native.py), so both stay correct: 768 tests, about 30 s
# more on 2 workers.
TEST_WORKERS ?= 2
# The 25 slowest tests are listed at the end of the compiled run: the suite has a 20-minute budget.
PURE_TESTS := tests/test_codec_roundtrip.py tests/test_codec_vectors.py tests/test_codec_malformed.py tests/test_topics.py \
	tests/test_core.py tests/test_limits.py tests/test_protocol_glue.py tests/test_fuzz.py tests/test_store_names.py
test: venv deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --core compiled --durations=25
	EDGE_GATEWAY_PURE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --core pure -q $(PURE_TESTS)

# Benchmarks side by side with Mosquitto (bench/run.py about 10 min on 2 cores, the scripts after it ~15 min). amqtt, the Python reference, lives in its
# own venv; if it cannot be installed its cells say n/a. `make bench BENCH_ARGS=--quick` for one short run.
AMQTT_VENV := bench/.venv-amqtt
AMQTT_VERSION := 0.12.1

$(AMQTT_VENV)/.installed:
	$(PYTHON) -m venv $(AMQTT_VENV)
	$(AMQTT_VENV)/bin/pip install -q --upgrade pip
	$(AMQTT_VENV)/bin/pip install -q 'amqtt==$(AMQTT_VERSION)' && touch $@ || echo "amqtt not installed: its cells will say n/a"

# The load generator in C where bench/loadgen.py's Python one was the bound (docs/benchmarks.md "The C load
# generator"): the idle-connection opener (bench/cloadgen/cloadgen.c: Mosquitto's connect rate), the message rows'
# subscribers (bench/cloadgen/sub.c) and the QoS 1 and QoS 2 rows' publishers (bench/cloadgen/pub.c). libc only;
# gcc comes with `compiler`.
CLOADGEN := bench/cloadgen/cloadgen
CLOADGEN_CFLAGS := -std=c11 -O2 -Wall -Wextra
CLOADGEN_SOURCES := bench/cloadgen/cloadgen.c bench/cloadgen/sub.c bench/cloadgen/pub.c
$(CLOADGEN): $(CLOADGEN_SOURCES) bench/cloadgen/cloadgen.h
	@command -v gcc >/dev/null || $(MAKE) --no-print-directory compiler
	gcc $(CLOADGEN_CFLAGS) -o $@ $(CLOADGEN_SOURCES)

cloadgen: $(CLOADGEN)

bench: venv deps $(AMQTT_VENV)/.installed $(CLOADGEN)
	$(BIN)/python bench/run.py $(BENCH_ARGS)
	$(BIN)/python bench/ws_fanin.py  # QoS 0 fan-in over WebSockets beside Mosquitto's websockets listener (~1 min)
	$(BIN)/python bench/lander_rate.py  # the fleet lander's rate (MQTT -> landing files) beside the gateway's forwarded rate (~1 min)
	$(BIN)/python bench/restart.py  # restart to READY=1 with 10^6 queued messages in 1,000 offline sessions, beside Mosquitto (~4 min)
	$(BIN)/python bench/many_clients.py  # 10,000 clients publishing QoS 1 once a second + idle ones, beside Mosquitto (~8 min)
	$(BIN)/python bench/slow_disk.py  # durable QoS 1 publish with 5 ms added to every fsync (group commit; ~3 min)
	$(BIN)/python bench/instructions.py  # instructions a connection, durable publish and drained message cost each broker, under callgrind (~1 min)
	$(BIN)/python bench/durable_commits.py  # the durable publish commit by commit: messages a commit, time in LMDB's commit (~15 s)

# The fleet pipeline on a Spark standalone cluster (tests/test_pipeline_cluster.py; not part of `make test`: about
# 4 min on the shared 2-core machine): a master and two workers on 127.0.0.1, spark-submit of `run all`, every table
# compared with the local[*] run.
test-cluster: venv deps
	FLEET_CLUSTER_TEST=1 $(BIN)/python -m pytest tests/test_pipeline_cluster.py -q

# Provisioning across architectures (tests/test_cross_arch.py; not part of `make test`: about 30 min per board on the
# shared 2-core machine, README "Provisioning across architectures"): arm64 and armhf Debian roots (mmdebstrap --arch,
# cached under build/cross/) run under qemu-user, registered with binfmt_misc for the test only, provisioned by
# ansible/site.yml through the chroot connection; inside each: --version, check-config, a QoS 1 round trip. Needs root.
CROSS_APT_PACKAGES := mmdebstrap arch-test qemu-user-static

test-cross: venv deps
	@missing=""; for p in $(CROSS_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	CROSS_ARCH_TEST=1 $(BIN)/python -m pytest tests/test_cross_arch.py -q

# Soak test (bench/soak.py, docs/reliability.md "Soak test"; not part of `make test`): 30 min of normal QoS 1 pairs
# beside hostile clients (long names, stuck subscribers, garbage, floods), the broker killed with kill -9 every 180 s;
# fails when an acknowledged message is lost or RSS passes 512 MiB. `make soak SOAK_ARGS="--minutes 3 --kill-every 60"`
# is short.
soak: venv deps
	$(BIN)/python bench/soak.py $(SOAK_ARGS)

# Fuzzing (not part of `make test`, which runs a short hypothesis version: tests/test_fuzz.py): the broker's
# packet handling in process under atheris (libFuzzer), FUZZ_RUNS inputs (1,000,000: about 170 a second per process
# on the loaded 2-core development machine, docs/reliability.md "Fuzzing"); stops at the first input that breaks
# an invariant and saves it under var/fuzz/.
# FUZZ_ARGS adds libFuzzer flags (`-seed=N`, `-max_total_time=S`); run two with FUZZ_RUNS=500000 to use two cores.
# FUZZ_STORE=lmdb runs the broker on the real LMDB store (in var/fuzz/lmdb-store, or FUZZ_STORE_DIR=/dev/shm/x: an
# fsync per change costs on a disk) instead of in memory.
FUZZ_RUNS ?= 1000000
FUZZ_STORE ?= memory
fuzz: venv
	@$(BIN)/python -c "import atheris" 2>/dev/null || $(BIN)/pip install -q 'atheris>=2.3'
	mkdir -p var/fuzz
	cd var/fuzz && FUZZ_STORE=$(FUZZ_STORE) ../../$(BIN)/python ../../tests/fuzz_main.py -runs=$(FUZZ_RUNS) -artifact_prefix=./ $(FUZZ_ARGS)

# The gateway image (README "The appliance"): a Debian bookworm root filesystem from the host's apt mirror,
# provisioned with ansible/site.yml through the chroot connection, written as build/appliance/edge-gateway-$(ARCH).img
# (boot, A/B read-only root slots and data partitions) + .bmap. Needs root. `make image-test` boots it under qemu (TCG)
# through its own boot loader, checks the services inside and cuts its power 3 times (image/vm_test.py). ARCH=arm64:
# the Raspberry Pi / arm64 image, built with qemu-user (binfmt_misc registered for the build only) and booted under
# qemu-system-aarch64 -M virt through U-Boot (u-boot-qemu's qemu_arm64 as its firmware, the image's boot.scr; not in make
# test: about 22 min to build, 11 with the base cached, and 6 min to boot, check and cut the power 3 times on this
# 2-core machine: README "The arm64 image"). Its MQTT codec and broker core are compiled for arm64 under qemu-user in a
# second cached root (the base plus gcc; the image's root gets none): about 18 min more whenever the core's sources
# change, cached otherwise (docs/compiled.md); `edge-gateway version --verbose` in the image says `core: compiled`. `make image-test` rebuilds the image first; image/boot-test.sh boots a
# built one again (IMAGE_ARCH=arm64).
# `make image-powercut RUNS=20`: the power-cut soak (RUNS SIGKILLs of qemu mid-stream, one boot each).
ARCH ?= amd64
RUNS ?= 20
IMAGE_APT_PACKAGES := mmdebstrap arch-test qemu-system-x86 qemu-system-arm qemu-user-static e2fsprogs dosfstools mtools \
	fdisk bmap-tools strace ovmf rauc squashfs-tools u-boot-tools u-boot-qemu

image-deps:
	@missing=""; for p in $(IMAGE_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

image: venv image-deps
	IMAGE_ARCH=$(ARCH) image/build.sh

image-test: image
	IMAGE_ARCH=$(ARCH) image/boot-test.sh

# The field-update test (image/update_test.py; not part of `make test`, see README "Updating gateways in the
# field" for its stage times): the image booted through its boot loader (amd64 OVMF and GRUB, arm64 U-Boot), v1 -> v2
# by rauc install, three bundles refused, a broken v3 rolled back by the health check and the boot loader, a power cut
# during an install.
image-update-test: image
	$(BIN)/python image/update_test.py --arch $(ARCH)

# A signed RAUC update bundle of the image's root (image/rauc/bundle.sh): build/appliance/edge-gateway-VERSION-ARCH.raucb.
# Signed with IMAGE_SIGNING_CERT / IMAGE_SIGNING_KEY, else a development key made once (build/appliance/keys/, loudly).
bundle: image
	IMAGE_ARCH=$(ARCH) image/rauc/bundle.sh --arch $(ARCH)

image-powercut: image
	IMAGE_ARCH=$(ARCH) IMAGE_POWER_CUTS=$(RUNS) image/boot-test.sh

clean:
	rm -rf $(VENV) var .pytest_cache $(CLOADGEN)
