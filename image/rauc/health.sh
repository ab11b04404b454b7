#!/bin/sh
# edge-gateway-health.service: after a boot, decide whether the booted root slot is good.
#
# Good: edge-gateway reached READY (Type=notify: active) with its store opened cleanly (no "STORE CORRUPT" in this
# boot's journal), firmware-bridge is active, and, when gateway.toml has an [[upstream]], a link connected once or
# HEALTH_UPSTREAM_WAIT seconds passed (a cloud that is down must not roll back a good update). Then `rauc status
# mark-good` (the boot counter starts again) and the slot's version is remembered as confirmed.
# Not good within HEALTH_TIMEOUT seconds, or a service that gave up or restarted HEALTH_MAX_RESTARTS times without
# coming up: on a slot whose version was never confirmed (the first boots after an
# update) `rauc status mark-bad` and a reboot: the boot loader (GRUB on amd64, U-Boot on arm64) then boots the other
# slot, the previous system. On a confirmed
# slot a failure is not the update's fault: it is logged, and the slot is marked good all the same (a failing
# service must not send a gateway back to an older system).
# Each outcome is logged, written to /var/lib/edge-gateway/update/last (KEY=value lines) and published retained on
# the local broker as gateway/<gateway_id>/update (a JSON object), which an [[upstream.forward]] rule for
# gateway/# sends to the cloud.
set -u
PATH=/usr/sbin:/usr/bin:/sbin:/bin
GW=edge-gateway.service
BRIDGE=firmware-bridge.service
STATE=/var/lib/edge-gateway/update
CONFIG=${EDGE_GATEWAY_CONFIG:-/etc/edge-gateway/gateway.toml}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-300}
HEALTH_UPSTREAM_WAIT=${HEALTH_UPSTREAM_WAIT:-120}
HEALTH_MAX_RESTARTS=${HEALTH_MAX_RESTARTS:-3}

say() { echo "edge-gateway-health: $*"; }
uptime_s() { cut -d. -f1 /proc/uptime; }
slot=$(sed -n 's/.*rauc\.slot=\([A-Za-z0-9]*\).*/\1/p' /proc/cmdline)
version=$(sed -n 's/^VERSION=//p' /etc/edge-gateway-release 2>/dev/null)
version=${version:-unknown}
install -d -m 0755 "$STATE"
confirmed=$(cat "$STATE/confirmed-$slot" 2>/dev/null || true)

# The slot the boot loader should have booted, from the state of RAUC's boot loader backend (bootloader= in
# /etc/rauc/system.conf). Booting another one means the boot loader fell back: that slot used up its boots without
# being marked good. (RAUC's own "primary" is no help here: it names a slot on trial only once it is marked good.)
#   grub (amd64, grubenv): the first of ORDER that is still OK (mark-bad clears A_OK/B_OK, used-up tries leave it).
#   uboot (arm64, fw_printenv): the first of BOOT_ORDER. Used-up boots and mark-bad both leave BOOT_x_LEFT=0, so
#   only the order says which slot was meant: RAUC puts the slot it installed first, and a fallback leaves it there.
# Both stay so after a rollback until the next install: the rollback is reported at the first healthy boot after it,
# not at every boot (see "reported" below).
bootloader=$(sed -n 's/^bootloader=//p' /etc/rauc/system.conf 2>/dev/null)
preferred=""
case "$bootloader" in
    grub)
        grubenv=$(grub-editenv "$(sed -n 's/^grubenv=//p' /etc/rauc/system.conf)" list 2>/dev/null)
        for s in $(echo "$grubenv" | sed -n 's/^ORDER=//p'); do
            if [ "$(echo "$grubenv" | sed -n "s/^${s}_OK=//p")" = 1 ]; then preferred=$s; break; fi
        done ;;
    uboot)
        for s in $(fw_printenv -n BOOT_ORDER 2>/dev/null); do preferred=$s; break; done ;;
esac

deadline=$(( $(uptime_s) + HEALTH_TIMEOUT ))
why=""
healthy() {
    why=""
    systemctl is-active --quiet "$GW" || { why="$GW is $(systemctl show -p ActiveState --value $GW)"; return 1; }
    if journalctl -b -u "$GW" -o cat --no-pager 2>/dev/null | grep -q 'STORE CORRUPT'; then
        why="the store did not open cleanly (quarantined)"; return 1
    fi
    systemctl is-active --quiet "$BRIDGE" || { why="$BRIDGE is $(systemctl show -p ActiveState --value $BRIDGE)"; return 1; }
    if grep -q '^\[\[upstream\]\]' "$CONFIG" 2>/dev/null; then
        if ! journalctl -b -u "$GW" -o cat --no-pager 2>/dev/null | grep -q 'upstream .*: connected to' \
            && [ "$(uptime_s)" -lt "$up_wait_until" ]; then
            why="no upstream link connected yet"; return 1
        fi
    fi
    return 0
}
# A unit that gave up (failed: StartLimitBurst reached) or keeps failing (HEALTH_MAX_RESTARTS automatic restarts
# without becoming active) will not come up by waiting: the rollback starts then, not at HEALTH_TIMEOUT, so the
# gateway is back on the previous system within a minute or two.
gave_up() {
    for unit in "$GW" "$BRIDGE"; do
        state=$(systemctl show -p ActiveState --value "$unit")
        restarts=$(systemctl show -p NRestarts --value "$unit")
        if [ "$state" = failed ] || { [ "$state" != active ] && [ "${restarts:-0}" -ge "$HEALTH_MAX_RESTARTS" ]; }; then
            why="$unit is $state after ${restarts:-0} automatic restarts"
            return 0
        fi
    done
    return 1
}
up_wait_until=$(( $(uptime_s) + HEALTH_UPSTREAM_WAIT ))
waited=""
until healthy; do
    if [ "$(uptime_s)" -ge "$deadline" ]; then why="$why after ${HEALTH_TIMEOUT}s"; break; fi
    if gave_up; then break; fi
    if [ "$why" != "$waited" ]; then say "waiting: $why"; waited=$why; fi
    sleep 2
done

previous=$(sed -n 's/^VERSION=//p' "$STATE/last" 2>/dev/null)
last_outcome=$(sed -n 's/^OUTCOME=//p' "$STATE/last" 2>/dev/null)
last_slot=$(sed -n 's/^SLOT=//p' "$STATE/last" 2>/dev/null)
# this slot and version already reported as the one the boot loader fell back to
reported=""
[ "$last_outcome" = rolled_back ] && [ "$last_slot" = "$slot" ] && [ "$previous" = "$version" ] && reported=yes
report() {  # report OUTCOME DETAIL: the log, $STATE/last, and gateway/<id>/update on the local broker
    outcome=$1; detail=$2
    now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    say "$outcome: slot $slot version $version (before: ${previous:-none}); $detail"
    printf 'OUTCOME=%s\nSLOT=%s\nVERSION=%s\nPREVIOUS=%s\nAT=%s\nDETAIL=%s\n' "$outcome" "$slot" "$version" \
        "${previous:-}" "$now" "$detail" > "$STATE/last.new" && mv "$STATE/last.new" "$STATE/last"
    # the gateway id and a plain MQTT listener on loopback, from the broker's configuration
    found=$(python3 -c '
import socket, sys, tomllib
with open(sys.argv[1], "rb") as f:
    cfg = tomllib.load(f)
binds = [(str(z.get("bind", "")), z) for z in cfg.get("listeners", {}).values()]
port = next((b.rsplit(":", 1)[1] for b, z in binds
             if b.startswith("127.0.0.1:") and z.get("protocol", "mqtt") == "mqtt" and not z.get("certfile")), "")
print(cfg.get("broker", {}).get("gateway_id") or socket.gethostname(), port)
' "$CONFIG" 2>/dev/null)
    gateway_id=${found% *}
    port=${found##* }
    json=$(printf '{"outcome": "%s", "slot": "%s", "version": "%s", "previous": "%s", "at": "%s", "detail": "%s"}' \
        "$outcome" "$slot" "$version" "${previous:-}" "$now" "$(echo "$detail" | tr -d '"\\')")
    # Retried while the broker runs (it may be restarting); a broker that is not running (the rollback of an update
    # whose broker cannot start) gets one try, so the rollback is not held up for a minute.
    tries="1 2 3 4 5 6 7 8 9 10 11 12"
    systemctl is-active --quiet "$GW" || tries=1
    if [ -n "$port" ]; then
        for _ in $tries; do
            timeout 20 mosquitto_pub -h 127.0.0.1 -p "$port" -q 1 -r -t "gateway/$gateway_id/update" -m "$json" \
                2>/run/edge-gateway-health.err && return 0
            sleep 5
        done
        say "could not publish gateway/$gateway_id/update: $(cat /run/edge-gateway-health.err)"
    fi
}
mark() {  # mark good|bad: rauc status mark-good|mark-bad booted, its failure said
    if ! rauc status "mark-$1" booted > /run/edge-gateway-health.rauc 2>&1; then
        say "rauc status mark-$1 booted failed: $(tr '\n' ' ' < /run/edge-gateway-health.rauc)"
        return 1
    fi
}

if [ -z "$why" ]; then
    mark good
    if [ "$confirmed" != "$version" ]; then
        echo "$version" > "$STATE/confirmed-$slot.new" && mv "$STATE/confirmed-$slot.new" "$STATE/confirmed-$slot"
    fi
    if [ "$last_outcome" = rolling_back ]; then
        report rolled_back "the update to $previous was not healthy: back on slot $slot"
    elif [ -n "$preferred" ] && [ "$preferred" != "$slot" ] && [ -z "$reported" ]; then
        report rolled_back "the boot loader ($bootloader) fell back to slot $slot: slot $preferred did not come up"
    elif [ -n "$previous" ] && [ "$previous" != "$version" ]; then
        report updated "healthy: marked good"
    elif [ ! -e "$STATE/last" ]; then
        report installed "healthy: marked good"
    else
        say "healthy: slot $slot version $version marked good"
    fi
    exit 0
fi
if [ "$confirmed" = "$version" ]; then
    say "not healthy ($why), but slot $slot was confirmed with version $version before: marked good, no rollback"
    mark good
    exit 1
fi
if ! ls "$STATE"/confirmed-* 2>/dev/null | grep -qv "confirmed-$slot\$"; then
    # the other slot never ran healthy (a new gateway's first boots): there is nothing to roll back to
    say "not healthy ($why); no other slot was ever confirmed, so slot $slot stays (no rollback)"
    mark good
    exit 1
fi
report rolling_back "not healthy: $why; marking slot $slot bad and rebooting"
journalctl -b -u "$GW" -n 20 -o cat --no-pager 2>/dev/null | sed 's/^/edge-gateway-health:   /'
mark bad
sync
systemctl reboot
exit 1
