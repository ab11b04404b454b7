#!/bin/sh
# The in-image probe of `make image-test` (image/boot-test.sh reads its lines from the serial log).
# Each check prints one line "edge-gateway-probe: PASS <name> ..." or "edge-gateway-probe: FAIL <name> ...",
# then "edge-gateway-probe: DONE" and the machine powers off.
#
# With edge_gateway.powercut=first|again on the kernel command line (the power-cut test, image/vm_test.py) it does not
# power off: it reports the store and the disk ("STORE ...", "DISK ..."), brings up the qemu user network (a static
# address in /run) and serves the broker's loopback listener on 0.0.0.0:1885 (systemd-socket-proxyd: the host reaches
# it only through qemu's hostfwd on its own 127.0.0.1), prints "SERVING" and waits for the host to cut the power.
# "again" (each boot after a cut) runs only the first check before that.
set -u
PATH=/usr/sbin:/usr/bin:/sbin:/bin
# The probe's parameters (edge_gateway.*): qemu's fw_cfg entry opt/edge_gateway/probe, where the test boots through
# the image's boot loader, which owns the command line (amd64: OVMF and GRUB; arm64 virt: U-Boot), and the kernel
# command line (arm64 on qemu's raspi3b, which has no fw_cfg: qemu puts them into the device tree, where U-Boot's
# boot script takes the command line from, as the Pi firmware does). A board has neither, so the probe stays inert.
params() {
    cat /proc/cmdline
    modprobe -q qemu_fw_cfg 2>/dev/null
    cat /sys/firmware/qemu_fw_cfg/by_name/opt/edge_gateway/probe/raw 2>/dev/null
}
PARAMS=" $(params | tr '\n' ' ') "
param() { echo "$PARAMS" | sed -n "s/.* edge_gateway\.$1=\([^ ]*\) .*/\1/p"; }
if [ "${1:-}" = --wanted ]; then  # the unit's ExecCondition: run only when asked to
    [ "$(param probe)" = 1 ]
    exit
fi
GW=edge-gateway.service
BRIDGE=firmware-bridge.service

say() { echo "<4>edge-gateway-probe: $*" > /dev/kmsg; }
pass() { say "PASS $*"; }
fail() { say "FAIL $*"; failed=1; }
failed=0

# edge_gateway.probe_scale=N on the kernel command line multiplies the probe's time limits (image/vm_test.py passes
# it where the emulation is slower, e.g. 3 for arm64 under TCG): the same checks, more time to get there.
scale=$(param probe_scale)
scale=${scale:-1}
# wait_for SECONDS COMMAND...: poll until COMMAND succeeds (within SECONDS times the scale).
wait_for() {
    limit=$(($1 * scale)); shift
    end=$(( $(cut -d. -f1 /proc/uptime) + limit ))
    until "$@" >/dev/null 2>&1; do
        [ "$(cut -d. -f1 /proc/uptime)" -ge "$end" ] && return 1
        sleep 1
    done
}
journal() {  # the last lines of a unit's journal, to the console
    journalctl -u "$1" -n "${2:-15}" --no-pager -o cat 2>&1 | while IFS= read -r line; do say "  $1: $line"; done
}
prop() { systemctl show -p "$2" --value "$1"; }
# Local tools use the internal loopback listener (1884), the image's only one: the external listener (TLS on 8883,
# anonymous clients refused) needs a board's certificate and key, which a generic image does not hold
# (ansible/inventory/image/hosts.yml; a board gets them from its per-board settings).
roundtrip() {  # roundtrip TOPIC: a QoS 1 message from mosquitto_pub reaches mosquitto_sub through the broker
    token="rt-$(cut -d' ' -f1 /proc/uptime)-$$"
    rm -f /run/probe-rt
    mosquitto_sub -h 127.0.0.1 -p 1884 -q 1 -t "$1" -C 1 -W $((60 * scale)) > /run/probe-rt 2>&1 &
    sub=$!
    n=0
    while kill -0 "$sub" 2>/dev/null && [ "$n" -lt $((60 * scale)) ]; do  # until the subscriber has it (it may subscribe late)
        mosquitto_pub -h 127.0.0.1 -p 1884 -q 1 -t "$1" -m "$token" >/dev/null 2>&1
        sleep 1; n=$((n + 1))
    done
    wait "$sub"
    [ "$(head -n1 /run/probe-rt)" = "$token" ]
}

# The power-cut test's report: the store opened cleanly or was quarantined (the broker's journal of this boot), and
# the disk under the store with its write cache mode and the flushes the kernel sent it since boot.
store_report() {
    if journalctl -u "$GW" -o cat --no-pager 2>/dev/null | grep -q 'STORE CORRUPT'; then
        say "STORE quarantined: $(journalctl -u "$GW" -o cat --no-pager | grep -m1 'STORE CORRUPT' | head -c 300)"
    else
        say "STORE clean: $(journalctl -u "$GW" -o cat --no-pager 2>/dev/null | grep -m1 'store: LMDB at' | head -c 200)"
    fi
    src=$(findmnt -n -o SOURCE --target /var/lib/edge-gateway)
    part=$(basename "$src")
    disk=$(basename "$(readlink -f "/sys/class/block/$part/..")")
    [ -e "/sys/block/$part" ] && disk=$part
    # /sys/block/DISK/stat: field 16 is the number of flush requests completed (Documentation/block/stat.rst).
    say "DISK /var/lib/edge-gateway on $src ($(findmnt -n -o FSTYPE,OPTIONS --target /var/lib/edge-gateway)), $disk write_cache=$(cat "/sys/block/$disk/queue/write_cache"), flushes=$(awk '{print $16}' "/sys/block/$disk/stat")"
}
serve() {
    install -d /run/systemd/network
    printf '[Match]\nName=en* eth*\n\n[Network]\nAddress=10.0.2.15/24\nLinkLocalAddressing=no\n' \
        > /run/systemd/network/10-edge-gateway-probe.network
    systemctl start systemd-networkd.service
    systemd-socket-activate -l 0.0.0.0:1885 /usr/lib/systemd/systemd-socket-proxyd 127.0.0.1:1884 \
        > /run/probe-proxy.log 2>&1 &
    wait_for 60 grep -q 10.0.2.15 /proc/net/fib_trie || say "no address 10.0.2.15: $(ls /sys/class/net | tr '\n' ' ')"
    say "SERVING 0.0.0.0:1885 -> 127.0.0.1:1884 (systemd-socket-proxyd), up $(cut -d' ' -f1 /proc/uptime) s"
    commands
    sleep infinity
}

# The update test (image/update_test.py) drives a served boot through the broker itself: a line on probe/command
# (QoS 1, from the host through the forwarded port) is one command, and its result comes back on the console.
#   slot                 SLOT booted=A primary=A version=... and rauc's view of both slots
#   health               waits for edge-gateway-health.service, then HEALTH <its outcome file>
#   install FILE         rauc install of FILE on the stick (the second disk, a FAT file system labelled EG-STICK):
#                        INSTALLED FILE, or REFUSED FILE: rauc's error
#   settings             SETTINGS gateway_id=<the broker's> boot=[settings files on the boot partition]
#                        unit=<edge-gateway-settings.service's result> ssh=<ssh.service's state>
#   reboot               systemctl reboot (qemu runs with -no-reboot: the test boots the disk again; a qemu
#                        started to reboot in place, for a playbook's reboot, comes back by itself)
#   poweroff             systemctl poweroff (ends the qemu run either way)
slot_report() {
    slots=$(rauc status --output-format=json 2>/dev/null | python3 -c '
import json, sys
status = json.load(sys.stdin)
slots = status.get("slots", [])
names = {n: i.get("bootname", "") for slot in (slots if isinstance(slots, list) else [slots]) for n, i in slot.items()}
print("booted=%s primary=%s" % (names.get(status.get("booted"), status.get("booted") or "?"),
                                names.get(status.get("boot_primary"), "?")))' 2>/dev/null)
    say "SLOT ${slots:-booted=? primary=?} version=$(sed -n 's/^VERSION=//p' /etc/edge-gateway-release)"
    rauc status --detailed 2>&1 | grep -E 'rootfs\.[01]|boot status|bundle.version|installed.timestamp' \
        | while IFS= read -r line; do say "  rauc: $line"; done
}
commands() {
    mosquitto_sub -h 127.0.0.1 -p 1884 -q 1 -i probe-commands -t probe/command 2>/dev/null | while read -r cmd arg; do
        case "$cmd" in
            slot) slot_report ;;
            health)
                wait_for 600 sh -c '[ "$(systemctl show -p ActiveState --value edge-gateway-health.service)" != activating ]'
                say "HEALTH $(systemctl show -p Result --value edge-gateway-health.service) $(tr '\n' ' ' < /var/lib/edge-gateway/update/last 2>/dev/null)" ;;
            install)
                install -d /run/stick
                mountpoint -q /run/stick || mount -o ro /dev/disk/by-label/EG-STICK /run/stick
                if rauc install "/run/stick/$arg" > /run/probe-install.log 2>&1; then
                    say "INSTALLED $arg: $(tail -n1 /run/probe-install.log)"
                else
                    say "REFUSED $arg: $(grep -v '^installing' /run/probe-install.log | tail -n3 | tr '\n' ' ')"
                fi ;;
            settings)
                cfg=/etc/edge-gateway/gateway.toml
                [ -e /var/lib/edge-gateway/settings/current/gateway.toml ] && cfg=/var/lib/edge-gateway/settings/current/gateway.toml
                gid=$(sed -n 's/^[[:space:]]*gateway_id[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' "$cfg" | head -1)
                say "SETTINGS gateway_id=$gid boot=[$(ls /boot/firmware | grep '^edge-gateway-settings' | tr '\n' ' ')] unit=$(systemctl show -p Result --value edge-gateway-settings.service) ssh=$(systemctl is-active ssh.service)" ;;
            reboot) say "REBOOTING"; systemctl reboot ;;
            poweroff) say "POWERING OFF"; systemctl poweroff ;;
            *) say "UNKNOWN command $cmd" ;;
        esac
    done
}
powercut=$(param powercut)

say "START $(uname -r) $(uname -m), up $(cut -d' ' -f1 /proc/uptime) s, time limits x$scale"
say "ROOT / is $(findmnt -n -o SOURCE,FSTYPE,OPTIONS /)"  # read-only (README "Read-only root")

# 1. The broker is active only after READY=1 (Type=notify): listeners bound, store open.
if wait_for 180 systemctl is-active --quiet "$GW"; then
    pass "broker-active $GW is $(prop $GW ActiveState) after READY; pid $(prop $GW MainPID); status: $(prop $GW StatusText)"
else
    fail "broker-active $GW is $(prop $GW ActiveState)/$(prop $GW SubState)"; journal "$GW"
fi

if [ "$powercut" = again ]; then
    store_report
    say "DONE failed=$failed"
    serve
fi

# Which MQTT codec and broker core the installed broker runs: mypyc's compiled modules or their .py files
# (gateway/native.py; image/vm_test.py compares it with the edge-gateway wheel the image was provisioned from).
say "CORE $(/opt/edge-gateway/bin/edge-gateway version --verbose 2>&1 | sed -n 's/^core: //p' | head -c 300)"

# 2. A publish/subscribe round trip through the broker.
if roundtrip probe/roundtrip; then
    pass "pubsub-roundtrip QoS 1 message from mosquitto_pub reached mosquitto_sub on 127.0.0.1:1884 (the internal loopback listener)"
else
    fail "pubsub-roundtrip got '$(head -c 200 /run/probe-rt)'"
fi

# 3. firmware-bridge with the simulator on a pty: active (READY=1 once connected to the broker) and a reading arrives.
install -d -o firmware-bridge -g firmware-bridge -m 0755 /run/firmware-sim
setpriv --reuid=firmware-bridge --regid=firmware-bridge --init-groups \
    /opt/edge-gateway/bin/firmware-bridge simulate --link /run/firmware-sim/buoy-b01 --rate 2 \
    > /run/firmware-sim/simulator.log 2>&1 &
sim=$!
if wait_for 120 systemctl is-active --quiet "$BRIDGE"; then
    reading=$(mosquitto_sub -h 127.0.0.1 -p 1884 -t 'sensors/gw-image/#' -C 1 -W $((90 * scale)) -v 2>&1)
    case "$reading" in
        sensors/gw-image/*'"seq"'*)
            pass "bridge-reading $BRIDGE active, simulator on $(readlink /run/firmware-sim/buoy-b01): $(echo "$reading" | head -c 160)" ;;
        *)
            fail "bridge-reading no reading on sensors/gw-image/#: '$(echo "$reading" | head -c 200)'"
            journal "$BRIDGE"; sed 's/^/  simulator: /' /run/firmware-sim/simulator.log | head -20 > /dev/kmsg ;;
    esac
else
    fail "bridge-active $BRIDGE is $(prop $BRIDGE ActiveState)/$(prop $BRIDGE SubState)"; journal "$BRIDGE" 25
fi
bridge_pid=$(prop $BRIDGE MainPID)

# 4. A hung broker (SIGSTOP: no loop turns, no WATCHDOG=1) is killed by the watchdog and restarted.
old=$(prop $GW MainPID)
restarts=$(prop $GW NRestarts)
t0=$(cut -d' ' -f1 /proc/uptime)
kill -STOP "$old"
say "hung the broker: kill -STOP $old (WatchdogSec=$(prop $GW WatchdogUSec))"
restarted() { new=$(prop $GW MainPID); [ "$new" != "$old" ] && [ "$new" != 0 ] && systemctl is-active --quiet "$GW"; }
if wait_for 150 restarted; then
    t1=$(cut -d' ' -f1 /proc/uptime)
    why=$(journalctl -u "$GW" --no-pager -o cat 2>/dev/null | grep -m1 -i 'watchdog timeout')
    if [ "$(prop $GW NRestarts)" -gt "$restarts" ] && [ -n "$why" ]; then
        pass "watchdog-restart pid $old -> $(prop $GW MainPID) after $(echo "$t1 - $t0" | awk '{print $1 - $3}') s; NRestarts $restarts -> $(prop $GW NRestarts); journal: $why"
    else
        fail "watchdog-restart new pid but NRestarts $(prop $GW NRestarts), journal: '$why'"; journal "$GW" 25
    fi
else
    kill -CONT "$old" 2>/dev/null
    fail "watchdog-restart $GW still pid $(prop $GW MainPID), $(prop $GW ActiveState)/$(prop $GW SubState)"; journal "$GW" 25
fi

# 5. After the restart: the broker serves again and the bridge kept running (Wants=, not Requires=).
if roundtrip probe/after-restart; then
    pass "pubsub-after-restart round trip works through the restarted broker"
else
    fail "pubsub-after-restart got '$(head -c 200 /run/probe-rt)'"
fi
if [ "$(prop $BRIDGE MainPID)" = "$bridge_pid" ] && systemctl is-active --quiet "$BRIDGE"; then
    pass "bridge-survived-restart $BRIDGE still pid $bridge_pid"
else
    fail "bridge-survived-restart $BRIDGE pid $bridge_pid -> $(prop $BRIDGE MainPID), $(prop $BRIDGE ActiveState)"
fi

kill "$sim" 2>/dev/null
if [ "$powercut" = first ]; then
    store_report
    say "DONE failed=$failed"
    serve
fi
say "DONE failed=$failed"
systemctl --no-block poweroff
