#!/usr/bin/env bash
# `make image-test`: boot build/appliance/edge-gateway.ext4 under qemu (TCG, no network, no reboot) with the
# in-image probe (image/probe/probe.sh) and check its report in the serial log.
#
# Passes when every check printed PASS and none FAIL: the broker is active after READY=1, a publish/subscribe round
# trip works, firmware-bridge is active and publishes the simulator's readings from a pty, a broker hung with
# kill -STOP is killed by the systemd watchdog and restarted, the bridge survives that restart. The machine powers
# itself off at the end; a timeout (IMAGE_TEST_TIMEOUT, default 600 s) stops qemu otherwise.
set -euo pipefail
{  # the whole script is read before it runs: editing it during a build cannot break that build

ROOT_DIR=$(cd "$(dirname "$0")/.." && pwd)
OUT=${IMAGE_OUT:-$ROOT_DIR/build/appliance}
TIMEOUT=${IMAGE_TEST_TIMEOUT:-600}
ACCEL=${IMAGE_TEST_ACCEL:-tcg}
SERIAL_LOG="$OUT/serial.log"
CHECKS=(broker-active pubsub-roundtrip bridge-reading watchdog-restart pubsub-after-restart bridge-survived-restart)

for f in edge-gateway.ext4 vmlinuz initrd.img; do
    [ -f "$OUT/$f" ] || { echo "image-test: $OUT/$f is missing: make image" >&2; exit 1; }
done
command -v qemu-system-x86_64 >/dev/null || { echo "image-test: qemu-system-x86_64 missing: make image-deps" >&2; exit 1; }

rm -f "$SERIAL_LOG"
start=$SECONDS
set +e
# snapshot=on: the boot writes to a temporary overlay, the image stays as built.
timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 -accel "$ACCEL" -machine q35 -cpu max -smp 2 -m 1024 \
    -no-reboot -display none -monitor none -nic none -serial "file:$SERIAL_LOG" \
    -kernel "$OUT/vmlinuz" -initrd "$OUT/initrd.img" \
    -append "root=/dev/vda ro console=ttyS0 panic=-1 systemd.wants=edge-gateway-probe.service edge_gateway.probe=1" \
    -drive "file=$OUT/edge-gateway.ext4,format=raw,if=virtio,snapshot=on"
rc=$?
set -e
elapsed=$((SECONDS - start))

tr -d '\r' < "$SERIAL_LOG" | grep -a 'edge-gateway-probe:' | sed 's/^\[ *[0-9.]*\] //' || true
status=0
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "image-test: qemu did not power off within $TIMEOUT s"; status=1
elif [ "$rc" -ne 0 ]; then
    echo "image-test: qemu exited with $rc"; status=1
fi
for check in "${CHECKS[@]}"; do
    if ! grep -aq "edge-gateway-probe: PASS $check" "$SERIAL_LOG"; then
        echo "image-test: missing PASS $check"; status=1
    fi
done
if grep -aq 'edge-gateway-probe: FAIL' "$SERIAL_LOG"; then
    echo "image-test: a check failed"; status=1
fi
grep -aq 'edge-gateway-probe: DONE failed=0' "$SERIAL_LOG" || { echo "image-test: the probe did not finish"; status=1; }
boot=$(grep -a -m1 -o 'edge-gateway-probe: START.*' "$SERIAL_LOG" | grep -o 'up [0-9.]*' || true)
echo "image-test: qemu -accel $ACCEL ran $elapsed s (probe started $boot s after power-on); serial log: $SERIAL_LOG"
if [ "$status" -eq 0 ]; then
    echo "image-test: ${#CHECKS[@]} passed, 0 failed"
fi
exit "$status"
exit
}
