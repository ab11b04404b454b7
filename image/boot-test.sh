#!/usr/bin/env bash
# `make image-test [ARCH=amd64|arm64]`: boot the image under qemu (TCG) with the in-image probe, then cut its power
# IMAGE_POWER_CUTS times (default 3): image/vm_test.py (its docstring says what is checked and how).
#
# Passes when every probe check printed PASS (the broker is active after READY=1, a publish/subscribe round trip,
# firmware-bridge publishing the simulator's readings from a pty, a broker hung with kill -STOP killed by the systemd
# watchdog and restarted, the bridge surviving that) and, after each SIGKILL of qemu mid-stream, the VM booted again
# from the same disk, the store opened (cleanly or quarantined), and every QoS 1 message the host-side publisher saw
# acknowledged reached the persistent subscriber. Each qemu run is killed after IMAGE_TEST_TIMEOUT s (default 600;
# for arm64 every time limit, the probe's too, is 3 times longer: IMAGE_TEST_SCALE).
# IMAGE_TEST_ARGS adds vm_test.py options, e.g. "--machine raspi3b --power-cuts 0" for the arm64 image on qemu's
# Raspberry Pi 3 model (no network there, so no power cuts), or "--seed N" to repeat the kill points of a run.
set -euo pipefail
ROOT_DIR=$(cd "$(dirname "$0")/.." && pwd)
VENV_BIN=${VENV_BIN:-$ROOT_DIR/.venv/bin}
exec "$VENV_BIN/python" "$ROOT_DIR/image/vm_test.py" --arch "${IMAGE_ARCH:-amd64}" \
    --power-cuts "${IMAGE_POWER_CUTS:-3}" ${IMAGE_TEST_ARGS:-}
