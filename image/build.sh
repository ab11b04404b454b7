#!/usr/bin/env bash
# `make image`: a bootable Debian bookworm gateway root filesystem, provisioned with ansible/site.yml.
#
#   build/appliance/base.tar        mmdebstrap output (cached; rebuilt when this script or the package list changes)
#   build/appliance/rootfs/         the root filesystem, provisioned through Ansible's chroot connection
#   build/appliance/edge-gateway.ext4, vmlinuz, initrd.img     what gets flashed / booted
#
# Runs as root (mmdebstrap --mode=root, chroot, files owned by system users). mmdebstrap's temporary mounts of
# /proc, /sys and /dev live in a private mount namespace (unshare), so none can outlive the build; nothing is
# installed or registered on the host, and everything is written under build/appliance/.
set -euo pipefail
{  # the whole script is read before it runs: editing it during a build cannot break that build

ROOT_DIR=$(cd "$(dirname "$0")/.." && pwd)
OUT=${IMAGE_OUT:-$ROOT_DIR/build/appliance}
SUITE=bookworm
ARCH=${IMAGE_ARCH:-amd64}
VENV_BIN=${VENV_BIN:-$ROOT_DIR/.venv/bin}
IMAGE_SIZE_SLACK_MB=${IMAGE_SIZE_SLACK_MB:-256}
PACKAGES=(systemd systemd-sysv udev kmod e2fsprogs python3 python3-venv python3-packaging python3-apt mosquitto-clients
          initramfs-tools linux-image-"$ARCH")

log() { printf '[image %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { printf 'image: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap --mode=root, chroot provisioning)"
command -v mmdebstrap >/dev/null || die "mmdebstrap is missing: make image-deps (apt-get install mmdebstrap)"
command -v mkfs.ext4 >/dev/null || die "mkfs.ext4 is missing: apt-get install e2fsprogs"
[ -x "$VENV_BIN/ansible-playbook" ] || die "$VENV_BIN/ansible-playbook is missing: make venv (the deploy extra)"

mkdir -p "$OUT"
start=$SECONDS

# ---------------------------------------------------------------------------------------------- 1. base system
sources="$OUT/$SUITE.sources"
python3 "$ROOT_DIR/image/apt-sources.py" --suite "$SUITE" > "$sources.new"
mv "$sources.new" "$sources"
# The cache key: what goes into the base (bump BASE_RECIPE when the mmdebstrap options below change).
BASE_RECIPE=1
key=$( { printf '%s\n' "$BASE_RECIPE" "$ARCH" "${PACKAGES[@]}"; cat "$sources"; } | sha256sum | cut -c1-16)
base="$OUT/base-$ARCH-$key.tar"
if [ ! -f "$base" ]; then
    rm -f "$OUT"/base-"$ARCH"-*.tar
    log "mmdebstrap $SUITE/$ARCH from $(grep -m1 '^URIs:' "$sources" | cut -d' ' -f2) (the host's apt mirror)"
    include=$(IFS=,; echo "${PACKAGES[*]}")
    # --mode=root inside a private mount namespace: its bind mounts vanish with it, even on failure.
    unshare --mount --propagation private -- \
        mmdebstrap --mode=root --variant=minbase --arch="$ARCH" --include="$include" \
            --aptopt='Acquire::Retries "3"' \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            "$SUITE" "$base.part.tar" "$sources"
    mv "$base.part.tar" "$base"
    log "base system built ($((SECONDS - start)) s)"
else
    log "base system: cached $base"
fi

# ---------------------------------------------------------------------------------------------- 2. root filesystem
rootfs="$OUT/rootfs"
rm -rf "$rootfs"
mkdir -p "$rootfs"
tar --xattrs --xattrs-include='*' --numeric-owner -xpf "$base" -C "$rootfs"
echo edge-gateway > "$rootfs/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tedge-gateway\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' \
    > "$rootfs/etc/hosts"
printf '# <file system>\t<mount point>\t<type>\t<options>\t<dump>\t<pass>\nLABEL=edge-gateway\t/\text4\tdefaults,noatime\t0\t1\n' \
    > "$rootfs/etc/fstab"
: > "$rootfs/etc/machine-id"   # each board makes its own on first boot
rm -f "$rootfs/var/lib/dbus/machine-id"

# ---------------------------------------------------------------------------------------------- 3. provisioning
export ANSIBLE_CONFIG="$ROOT_DIR/ansible/ansible.cfg"
export ANSIBLE_HOME="$OUT/ansible-home" ANSIBLE_LOCAL_TEMP="$OUT/ansible-home/tmp"
export ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 PATH="$VENV_BIN:$PATH"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# IMAGE_ANSIBLE_ARGS: more ansible-playbook arguments, e.g. "-e gateway_id=gw-harbour-07" for a per-board image.
# shellcheck disable=SC2206
playbook=(ansible-playbook -i "$ROOT_DIR/ansible/inventory/image" -e "image_root=$rootfs" -e "appliance_wheel_dir=$OUT/wheels"
          ${IMAGE_ANSIBLE_ARGS:-} "$ROOT_DIR/ansible/site.yml")
log "provisioning with ansible/site.yml through the chroot connection"
"${playbook[@]}" > "$OUT/provision-1.log" 2>&1 || { tail -40 "$OUT/provision-1.log"; die "provisioning failed"; }
grep -A3 'PLAY RECAP' "$OUT/provision-1.log"
log "provisioning again: must report changed=0"
"${playbook[@]}" > "$OUT/provision-2.log" 2>&1 || { tail -40 "$OUT/provision-2.log"; die "second provisioning failed"; }
grep -A3 'PLAY RECAP' "$OUT/provision-2.log"
if grep -E '^(image|localhost) .*changed=[1-9]' "$OUT/provision-2.log"; then
    grep -B2 -E '^changed:' "$OUT/provision-2.log" | head -40
    die "the second run changed something: the playbook is not idempotent"
fi
rm -rf "$rootfs/root/.ansible" "$rootfs/tmp/"* 2>/dev/null || true

# ---------------------------------------------------------------------------------------------- 4. test probe
# Inert unless the kernel command line asks for it (make image-test boots with systemd.wants=edge-gateway-probe.service).
install -D -m 0755 "$ROOT_DIR/image/probe/probe.sh" "$rootfs/usr/local/lib/edge-gateway-probe/probe.sh"
install -D -m 0644 "$ROOT_DIR/image/probe/edge-gateway-probe.service" \
    "$rootfs/etc/systemd/system/edge-gateway-probe.service"

# ---------------------------------------------------------------------------------------------- 5. image
kernel=$(find "$rootfs/boot" -maxdepth 1 -name 'vmlinuz-*' | sort -V | tail -1)
initrd=$(find "$rootfs/boot" -maxdepth 1 -name 'initrd.img-*' | sort -V | tail -1)
[ -n "$kernel" ] && [ -n "$initrd" ] || die "no kernel/initrd in $rootfs/boot"
cp "$kernel" "$OUT/vmlinuz"
cp "$initrd" "$OUT/initrd.img"
used_mb=$(du -sm --apparent-size "$rootfs" | cut -f1)
size_mb=$(( (used_mb * 13 / 10) + IMAGE_SIZE_SLACK_MB ))
rm -f "$OUT/edge-gateway.ext4"
mkfs.ext4 -q -F -L edge-gateway -d "$rootfs" "$OUT/edge-gateway.ext4" "${size_mb}M"
log "image: $OUT/edge-gateway.ext4 (${size_mb} MiB, $used_mb MiB used), kernel $(basename "$kernel"), $((SECONDS - start)) s in all"
exit
}
