#!/usr/bin/env bash
# `make image [ARCH=amd64|arm64]`: a flashable Debian bookworm gateway disk image, provisioned with ansible/site.yml.
#
#   build/appliance/base-ARCH-KEY.tar        mmdebstrap output (cached; keyed by this recipe, the packages, the sources)
#   build/appliance/rootfs-ARCH/             the root filesystem, provisioned through Ansible's chroot connection
#                                            (removed once the root partition is made of it)
#   build/appliance/edge-gateway-ARCH.img    the disk, MBR: 1 boot (FAT32, EG-BOOT: amd64 the EFI system partition with
#                                            GRUB and its A/B state grubenv; arm64 U-Boot's boot.scr and its A/B state
#                                            boot-state.env, and the Raspberry Pi firmware), 2 and 3 the root slots A
#                                            and B (ext4, mounted read-only; B empty until the first update), 4 data
#                                            (ext4, eg-data, /var/lib/edge-gateway).
#   build/appliance/edge-gateway-ARCH.img.bmap      for `bmaptool copy`
#   build/appliance/edge-gateway-ARCH-root.ext4     the root partition alone: what `make bundle` signs for RAUC
#   build/appliance/edge-gateway-ARCH.version       the image's version (IMAGE_VERSION; /etc/edge-gateway-release)
#
# amd64 boots through GRUB (EFI), which picks the root slot with RAUC's boot counting (image/rauc/grub.cfg) and
# loads the kernel and initrd from that slot. arm64 boots through U-Boot, whose boot script (image/rauc/boot.cmd)
# does the same for RAUC's uboot backend: the board's U-Boot on generic arm64 and under qemu (Debian's u-boot-qemu),
# on the Raspberry Pi u-boot-rpi's, which the Pi firmware on the boot partition starts (config.txt kernel=u-boot.bin).
# Runs as root (mmdebstrap --mode=root, chroot, files owned by system users). mmdebstrap's temporary mounts of
# /proc, /sys and /dev live in a private mount namespace (unshare), so none can outlive the build. No loop device and
# no mount: the file systems are made from directories (mkfs.ext4 -d, mkfs.vfat + mcopy) and put into the disk with
# dd at the offsets sfdisk gave them. A foreign ARCH runs its maintainer scripts and the provisioning under qemu-user:
# binfmt_misc entries named edge-gateway-image-CPU-PID are registered for the build (through a private mount of
# binfmt_misc: the host's stays as it is) and removed when it ends, also on failure.
set -euo pipefail
{  # the whole script is read before it runs: editing it during a build cannot break that build

ROOT_DIR=$(cd "$(dirname "$0")/.." && pwd)
OUT=${IMAGE_OUT:-$ROOT_DIR/build/appliance}
SUITE=bookworm
ARCH=${IMAGE_ARCH:-amd64}
VENV_BIN=${VENV_BIN:-$ROOT_DIR/.venv/bin}
# The root partition has a fixed size, so the root of a later build fits it (re-flash the root, keep the data).
IMAGE_ROOT_MB=${IMAGE_ROOT_MB:-2048}
# The data partition: the LMDB store (store.max_size 1GB in the image inventory) and its headroom.
IMAGE_DATA_MB=${IMAGE_DATA_MB:-1280}
IMAGE_BOOT_MB=256
# The free space the build needs where it writes (MiB): at its peak the base tar (~0.7 GiB) beside mmdebstrap's
# chroot (~1 GiB), later the base tar, the root partition, the disk image and the power-cut copy of `make image-test`
# (~0.9 GiB each). Checked before anything is written, so a full disk stops the build and nothing else on it.
IMAGE_MIN_FREE_MB=${IMAGE_MIN_FREE_MB:-4096}
# The image's version: /etc/edge-gateway-release in the root, the version of the RAUC bundle made from it.
IMAGE_VERSION=${IMAGE_VERSION:-$(date -u +%Y.%m.%d.%H%M)-$(git -C "$ROOT_DIR" rev-parse --short HEAD 2>/dev/null || echo local)}
# The MBR disk identifier: the partitions' PARTUUIDs (RAUC's slots, the kernel's root=) are DISKID-01 ... -04.
DISKID=45474757
# openssh-server and sudo: the operator access that per-board settings can switch on (role operator_access);
# fdisk (sfdisk): the data partition grown to the end of the card at the first boot (image/data/grow-data.sh)
PACKAGES=(systemd systemd-sysv udev kmod e2fsprogs python3 python3-venv python3-packaging python3-apt mosquitto-clients
          initramfs-tools linux-image-"$ARCH" openssh-server sudo fdisk)
COMPONENTS=main
case "$ARCH" in
    # GRUB for EFI (its modules and grub-editenv, which RAUC's grub backend runs) and RAUC for the A/B updates: the
    # rauc command line hands every request to the rauc service (rauc-service) over the D-Bus system bus
    amd64) QEMU_CPU=x86_64; PACKAGES+=(grub-efi-amd64-bin rauc rauc-service dbus) ;;
    # U-Boot boots arm64 (image/rauc/boot.cmd): u-boot-rpi's rpi_arm64 build on the Raspberry Pi (started by the Pi
    # firmware of raspi-firmware), Debian's u-boot-qemu on generic boards and under qemu (the board's firmware, not
    # part of the image); RAUC's uboot backend reads and writes the boot state with libubootenv's fw_printenv and
    # fw_setenv
    arm64) QEMU_CPU=aarch64; COMPONENTS="main non-free-firmware"
           PACKAGES+=(raspi-firmware dosfstools u-boot-rpi libubootenv-tool rauc rauc-service dbus) ;;
    *) printf 'image: ARCH=%s: must be amd64 or arm64\n' "$ARCH" >&2; exit 2 ;;
esac

log() { printf '[image %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { printf 'image: %s\n' "$*" >&2; exit 1; }
stage_start=$SECONDS
stage() {  # stage NAME: prints the time the previous stage took
    [ -z "${stage_name:-}" ] || log "stage $stage_name: $((SECONDS - stage_start)) s"
    stage_name=$1; stage_start=$SECONDS
    [ "$1" = done ] || log "stage $1"
}

[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap --mode=root, chroot provisioning)"
tools=(mmdebstrap mkfs.ext4 mkfs.vfat mcopy sfdisk bmaptool)
[ "$ARCH" = arm64 ] && tools+=(mkimage mkenvimage)  # U-Boot's boot script and its A/B state (u-boot-tools)
for tool in "${tools[@]}"; do
    command -v "$tool" >/dev/null || die "$tool is missing: make image-deps"
done
[ -x "$VENV_BIN/ansible-playbook" ] || die "$VENV_BIN/ansible-playbook is missing: make venv (the deploy extra)"

mkdir -p "$OUT"
free_mb=$(df --output=avail -BM "$OUT" | tail -1 | tr -dc 0-9)
[ "$free_mb" -ge "$IMAGE_MIN_FREE_MB" ] \
    || die "not enough free space in $OUT: $free_mb MiB free, the build needs IMAGE_MIN_FREE_MB=$IMAGE_MIN_FREE_MB MiB"
# What the build wrote before the partitioned images (a bare ext4 root with its kernel and initrd beside it).
rm -rf "$OUT/edge-gateway.ext4" "$OUT/vmlinuz" "$OUT/initrd.img" "$OUT/wheels" "$OUT/provision-1.log" \
    "$OUT/provision-2.log" "$OUT/bookworm.sources" "$OUT/serial.log" "$OUT/serial-boot2.log"
exec 9> "$OUT/.build-$ARCH.lock"
flock -n 9 || die "another image build for $ARCH is running in $OUT"
start=$SECONDS

# ---------------------------------------------------------------------------------------------- 0. qemu-user
binfmt_names=()
binfmt_holder=
binfmt_cleanup() {
    for name in "${binfmt_names[@]}"; do
        printf -- -1 > "/proc/$binfmt_holder/root/proc/sys/fs/binfmt_misc/$name" 2>/dev/null \
            || printf 'image: could not remove the binfmt_misc entry %s\n' "$name" >&2
    done
    # (|| true: wait returns 143 for the killed holder, which set -e would make the build's exit status)
    if [ -n "$binfmt_holder" ]; then kill "$binfmt_holder" 2>/dev/null; wait "$binfmt_holder" 2>/dev/null || true; fi
    return 0
}
trap binfmt_cleanup EXIT
if [ "$(dpkg --print-architecture)" != "$ARCH" ]; then
    conf=/usr/lib/binfmt.d/qemu-$QEMU_CPU.conf
    [ -f "$conf" ] || die "$conf is missing: make image-deps (qemu-user-static)"
    # binfmt_misc mounted in a private mount namespace held open for the whole build: an entry lives only as long as
    # some mount of binfmt_misc does (Linux >= 6.7 drops the entries with the file system), and the host's
    # /proc/sys/fs/binfmt_misc stays as it is. The holder is killed by its PID at the end.
    unshare --mount --propagation private -- sh -c \
        'mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc && exec sleep infinity' &
    binfmt_holder=$!
    fs=/proc/$binfmt_holder/root/proc/sys/fs/binfmt_misc
    for _ in $(seq 100); do [ -e "$fs/register" ] && break; sleep 0.1; done
    [ -e "$fs/register" ] || die "cannot mount binfmt_misc in a private mount namespace"
    IFS=: read -r _ _ kind offset magic mask interpreter flags < "$conf"
    name=edge-gateway-image-$QEMU_CPU-$$
    # F: the interpreter is opened now, so it works inside the chroot too.
    printf '%s' ":$name:$kind:$offset:$magic:$mask:$interpreter:${flags//F/}F" > "$fs/register" \
        || die "cannot register qemu-$QEMU_CPU with binfmt_misc"
    binfmt_names+=("$name")
    log "qemu-user: registered binfmt_misc entry $name ($interpreter) for this build"
fi

# ---------------------------------------------------------------------------------------------- 1. base system
stage base
sources="$OUT/$SUITE-$ARCH.sources"
python3 "$ROOT_DIR/image/apt-sources.py" --suite "$SUITE" --components "$COMPONENTS" > "$sources.new"
mv "$sources.new" "$sources"
# The cache key: what goes into the base (bump BASE_RECIPE when the mmdebstrap options below change).
BASE_RECIPE=2
hooks=()
initramfs_files=()
if [ "$ARCH" = arm64 ]; then
    # Before the kernel is installed (mmdebstrap's essential hook runs between the Essential packages and --include):
    # an initramfs of the modules the boards need (MODULES=list), not Debian's "most", which under qemu-user took
    # most of an hour of mkinitramfs (README "The arm64 image").
    initramfs_files=("$ROOT_DIR/image/initramfs/edge-gateway.conf" "$ROOT_DIR/image/initramfs/edge-gateway-modules")
    hooks+=(--essential-hook="install -D -m 0644 $ROOT_DIR/image/initramfs/edge-gateway.conf \"\$1/etc/initramfs-tools/conf.d/edge-gateway.conf\"")
    hooks+=(--essential-hook="install -D -m 0755 $ROOT_DIR/image/initramfs/edge-gateway-modules \"\$1/etc/initramfs-tools/hooks/edge-gateway\"")
fi
key=$( { printf '%s\n' "$BASE_RECIPE" "$ARCH" "${PACKAGES[@]}"; cat "$sources" "${initramfs_files[@]}"; } \
       | sha256sum | cut -c1-16)
base="$OUT/base-$ARCH-$key.tar"
if [ ! -f "$base" ]; then
    rm -f "$OUT"/base-"$ARCH"-*.tar
    log "mmdebstrap $SUITE/$ARCH from $(grep -m1 '^URIs:' "$sources" | cut -d' ' -f2) (the host's apt mirror)"
    include=$(IFS=,; echo "${PACKAGES[*]}")
    # --mode=root inside a private mount namespace: its bind mounts vanish with it, even on failure.
    # Its output goes to mmdebstrap-ARCH.log with the time of each line (where the time goes under qemu-user).
    unshare --mount --propagation private -- \
        mmdebstrap --mode=root --variant=minbase --arch="$ARCH" --include="$include" --verbose \
            --aptopt='Acquire::Retries "3"' \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            "${hooks[@]}" "$SUITE" "$base.part.tar" "$sources" 2>&1 \
        | while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done > "$OUT/mmdebstrap-$ARCH.log" \
        || { tail -30 "$OUT/mmdebstrap-$ARCH.log"; die "mmdebstrap failed (log: $OUT/mmdebstrap-$ARCH.log)"; }
    grep -E 'Setting up linux-image|update-initramfs:|Processing triggers for initramfs|I: (running|cleaning)' \
        "$OUT/mmdebstrap-$ARCH.log" || true
    mv "$base.part.tar" "$base"
    log "base system built: $base"
else
    log "base system: cached $base"
fi

# ---------------------------------------------------------------------------------------------- 1b. compiled core
# The playbook, the wheels and a foreign architecture's compiled core come from a snapshot of the working tree taken
# now (tracked and untracked files, not the ignored ones): every step sees the same sources, and the second
# provisioning run must change nothing.
src="$OUT/src-$ARCH"
rm -rf "$src"
mkdir -p "$src"
git -C "$ROOT_DIR" ls-files -z --cached --others --exclude-standard \
    | tar -C "$ROOT_DIR" --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$src" -xf -
# The compiled core of these sources, when `make venv` built it (setup.py's build/core-cache): the playbook's wheel
# build copies it instead of running mypyc and the C compiler again, in each provisioning run.
if [ -d "$ROOT_DIR/build/core-cache" ]; then
    mkdir -p "$src/build"
    cp -a "$ROOT_DIR/build/core-cache" "$src/build/"
fi
wheels="$OUT/wheels-$ARCH"  # the controller's wheels: the playbook's first play builds them, target_wheels.py reads
mkdir -p "$wheels"
# The playbook builds the controller's edge-gateway wheel again; one left by an earlier build under another tag
# (pure before a compiler was there) must not stand beside it.
rm -f "$wheels"/edge_gateway-*.whl
# The MQTT codec and the broker core compiled by mypyc for a foreign ARCH (docs/compiled.md "Images and other
# architectures"): the controller's wheel is compiled for the controller. `pip wheel --no-deps` of the snapshot runs
# under qemu-user in a second cached root, the base plus a C compiler and Python's headers (the image's own root
# gets no compiler), and its wheel goes beside the controller's, where target_wheels.py takes its compiled modules
# for the target. Kept in core-ARCH-KEY/, keyed by the base and every file that decides the compiled output, so
# an unchanged core is not compiled again. The build requirements (setuptools, mypy and theirs, aarch64 wheels) are
# fetched on this machine with its pip configuration, as target_wheels.py fetches the target's wheels: pip in the
# root runs without an index. A failure of any of it leaves the image with the pure-Python core and says why;
# IMAGE_COMPILED_CORE=0 skips it.
if [ "$ARCH" != "$(dpkg --print-architecture)" ] && [ "${IMAGE_COMPILED_CORE:-1}" = 1 ]; then
    stage core
    CORE_RECIPE=1  # bump when the build below changes
    WHEELROOT_PACKAGES=(gcc libc6-dev python3-dev python3-venv)
    core_key=$( { printf '%s\n' "$CORE_RECIPE" "$key" "${WHEELROOT_PACKAGES[@]}"
                  cd "$src" && find setup.py pyproject.toml build_backend gateway/__init__.py gateway/mqtt \
                      gateway/broker gateway/store -name '*.py' -o -name '*.toml' 2>/dev/null \
                  | LC_ALL=C sort | xargs sha256sum; } | sha256sum | cut -c1-16)
    core_dir="$OUT/core-$ARCH-$core_key"
    core_log="$OUT/core-$ARCH.log"
    core_failed() {  # core_failed WHY: the image gets the pure-Python core
        log "compiled core for $ARCH: $1; the image runs the pure-Python codec and core (log: $core_log)"
        return 0
    }
    build_core() {  # the wheel into $core_dir, or return 1 with the reason in $core_log
        local wroot="$OUT/wheelroot-$ARCH" wkey wbase built
        wkey=$(printf '%s\n' "$key" "${WHEELROOT_PACKAGES[@]}" | sha256sum | cut -c1-16)
        wbase="$OUT/wheelroot-$ARCH-$wkey.tar"
        rm -rf "$wroot"
        mkdir -p "$wroot"
        if [ -f "$wbase" ]; then
            log "wheel root: cached $wbase"
            tar --xattrs --xattrs-include='*' --numeric-owner -xpf "$wbase" -C "$wroot"
        else
            rm -f "$OUT"/wheelroot-"$ARCH"-*.tar
            log "wheel root: the base plus ${WHEELROOT_PACKAGES[*]} (apt-get under qemu-user)"
            tar --xattrs --xattrs-include='*' --numeric-owner -xpf "$base" -C "$wroot"
            cp -L /etc/resolv.conf "$wroot/etc/resolv.conf"
            # env -i: nothing of this machine's environment (its pip settings, its PATH) reaches the root
            chroot "$wroot" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
                sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends ${WHEELROOT_PACKAGES[*]} \
                       && apt-get clean && rm -rf /var/lib/apt/lists/*" >> "$core_log" 2>&1 \
                || { echo "apt-get install ${WHEELROOT_PACKAGES[*]} failed in the wheel root" >> "$core_log"
                     return 1; }
            tar --xattrs --xattrs-include='*' --numeric-owner -C "$wroot" -cf "$wbase.part" . \
                && mv "$wbase.part" "$wbase"
        fi
        mkdir -p "$wroot/build/wheelhouse" "$wroot/build/out" "$wroot/build/check"
        cp -a "$src" "$wroot/build/src"
        # What pip needs to build the wheel: [build-system] requires and, for EDGE_GATEWAY_COMPILE=1, the build
        # backend's mypy (build_backend/edge_gateway_build.py), as wheels for the root's machine and Python.
        local requires python glibc platforms=()
        mapfile -t requires < <(cd "$src" && "$VENV_BIN/python" -c 'import sys, tomllib
sys.path.insert(0, "build_backend"); import edge_gateway_build as b
print("\n".join([*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], b.MYPY]))' 2>>"$core_log")
        [ "${#requires[@]}" -gt 0 ] || { echo "cannot read the build requirements" >> "$core_log"; return 1; }
        read -r python glibc < <(chroot "$wroot" /usr/bin/python3 -c \
            'import platform, sys; print("%d.%d" % sys.version_info[:2], platform.libc_ver()[1])')
        for n in $(seq "${glibc#2.}" -1 17); do platforms+=(--platform "manylinux_2_${n}_$QEMU_CPU"); done
        "$VENV_BIN/python" -m pip download -q --only-binary=:all: \
            "${platforms[@]}" --platform "manylinux2014_$QEMU_CPU" \
            --python-version "$python" --implementation cp --abi "cp${python/./}" --abi abi3 --abi none \
            -d "$wroot/build/wheelhouse" "${requires[@]}" >> "$core_log" 2>&1 \
            || { echo "pip download ${requires[*]} for $QEMU_CPU failed" >> "$core_log"; return 1; }
        log "pip wheel --no-deps of the snapshot under qemu-user (EDGE_GATEWAY_COMPILE=1, build requirements:" \
            "$(cd "$wroot/build/wheelhouse" && echo *.whl))"
        local t0=$SECONDS
        chroot "$wroot" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
            EDGE_GATEWAY_COMPILE=1 SOURCE_DATE_EPOCH=315532800 PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 \
            PIP_FIND_LINKS=/build/wheelhouse PIP_DISABLE_PIP_VERSION_CHECK=1 \
            sh -c 'python3 -m venv /build/venv &&
                   exec /build/venv/bin/pip wheel -v --no-deps --wheel-dir /build/out /build/src' \
            2>&1 | while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done >> "$core_log"
        [ "${PIPESTATUS[0]}" = 0 ] || { echo "pip wheel failed" >> "$core_log"; return 1; }
        log "pip wheel: $((SECONDS - t0)) s"
        built=$(find "$wroot/build/out" -name 'edge_gateway-*.whl')
        # setup.py falls back to the .py files when compiling fails, and says why (its "edge-gateway build:" warning,
        # which pip -v passes on): a wheel without the shared library is no compiled core.
        if [ -z "$built" ] || ! "$VENV_BIN/python" -c 'import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(not any(n.startswith("gateway/_core__mypyc.") and n.endswith(".so") for n in names))' \
                "$built"; then
            echo "the build compiled nothing: $(grep -o 'edge-gateway build: .*' "$core_log" | tail -1)" >> "$core_log"
            return 1
        fi
        # The compiled modules must load in the root's Python, as the installed broker would load them.
        (cd "$wroot/build/check" && "$VENV_BIN/python" -m zipfile -e "$built" .)
        chroot "$wroot" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin PYTHONPATH=/build/check /usr/bin/python3 -c '
import sys
from gateway import native
core = native.select()
print("core:", core.describe(), flush=True)
import gateway.broker.broker, gateway.mqtt.packets
sys.exit(0 if core.compiled and not gateway.broker.broker.__file__.endswith(".py") else 1)' >> "$core_log" 2>&1 \
            || { echo "the compiled modules do not load in the root's Python: $(tail -1 "$core_log")" >> "$core_log"
                 return 1; }
        rm -rf "$core_dir.part"
        mkdir -p "$core_dir.part"
        cp "$built" "$core_dir.part/"
        mv "$core_dir.part" "$core_dir"
        rm -rf "$wroot"
    }
    if [ -d "$core_dir" ]; then
        log "compiled core for $ARCH: cached $(echo "$core_dir"/*.whl)"
    else
        rm -rf "$OUT"/core-"$ARCH"-*/
        : > "$core_log"
        if build_core; then
            log "compiled core for $ARCH: $(echo "$core_dir"/*.whl)"
        else
            core_failed "$(tail -1 "$core_log")"
            rm -rf "$OUT/wheelroot-$ARCH"
        fi
    fi
    if [ -d "$core_dir" ]; then
        cp "$core_dir"/*.whl "$wheels/"
    fi
fi

# ---------------------------------------------------------------------------------------------- 2. root filesystem
stage rootfs
rootfs="$OUT/rootfs-$ARCH"
rm -rf "$rootfs" "$OUT/rootfs"  # (rootfs/: the name before the arm64 image)
mkdir -p "$rootfs"
tar --xattrs --xattrs-include='*' --numeric-owner -xpf "$base" -C "$rootfs"
echo edge-gateway > "$rootfs/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tedge-gateway\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' \
    > "$rootfs/etc/hosts"
# The root is read-only (README "Read-only root"): what must be written at run time is on the data partition
# (/var/lib/edge-gateway: the store) or in memory (/tmp, /var/tmp, /run; the journal is volatile, in /run).
# The root is whichever slot the boot loader booted (root=PARTUUID=... ro on the kernel command line): no line for it
# here (both slots carry the label eg-root). The boot partition is writable: RAUC's boot loader backend writes the A/B
# state there (grubenv, boot-state.env).
cat > "$rootfs/etc/fstab" <<'FSTAB'
# <file system>	<mount point>	<type>	<options>	<dump>	<pass>
LABEL=eg-data	/var/lib/edge-gateway	ext4	rw,noatime,nodev,nosuid,noexec	0	2
LABEL=EG-BOOT	/boot/firmware	vfat	rw,nofail,noatime,flush,umask=0077	0	2
tmpfs	/tmp	tmpfs	mode=1777,nosuid,nodev,size=64M	0	0
tmpfs	/var/tmp	tmpfs	mode=1777,nosuid,nodev,size=16M	0	0
FSTAB
# An empty machine-id on a read-only root: systemd makes a new one each boot and mounts it from /run.
: > "$rootfs/etc/machine-id"
rm -f "$rootfs/var/lib/dbus/machine-id"
mkdir -p "$rootfs/boot/firmware" "$rootfs/var/lib/edge-gateway"
# systemd-logind's StateDirectory: made here, as systemd cannot make it on the read-only root at boot
install -d -m 0755 "$rootfs/var/lib/systemd/linger"
if [ "$ARCH" = arm64 ]; then
    # raspi-firmware's own hooks (a kernel installed on a board) write cmdline.txt with these consoles; the root
    # is the slot U-Boot chose, which its boot script adds to the command line.
    printf 'ROOTPART=LABEL=eg-root\nCONSOLES="tty0 ttyS1,115200"\n' > "$rootfs/etc/default/raspi-firmware"
fi

# ---------------------------------------------------------------------------------------------- 3. provisioning
stage provisioning
export ANSIBLE_CONFIG="$src/ansible/ansible.cfg"
export ANSIBLE_HOME="$OUT/ansible-home" ANSIBLE_LOCAL_TEMP="$OUT/ansible-home/tmp"
export ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 PATH="$VENV_BIN:$PATH"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# IMAGE_ANSIBLE_ARGS: more ansible-playbook arguments, e.g. "-e gateway_id=gw-harbour-07" for a per-board image.
# shellcheck disable=SC2206
playbook=(ansible-playbook -i "$src/ansible/inventory/image" -e "image_root=$rootfs"
          -e "appliance_wheel_dir=$OUT/wheels-$ARCH" ${IMAGE_ANSIBLE_ARGS:-} "$src/ansible/site.yml")
log "provisioning with ansible/site.yml through the chroot connection"
"${playbook[@]}" > "$OUT/provision-$ARCH-1.log" 2>&1 || { tail -40 "$OUT/provision-$ARCH-1.log"; die "provisioning failed"; }
grep -A3 'PLAY RECAP' "$OUT/provision-$ARCH-1.log"
# IMAGE_PROVISION_RUNS=1 skips the second run (the same playbook is checked for changed=0 by the amd64 image in
# make test; under qemu-user a run of the arm64 root takes minutes).
if [ "${IMAGE_PROVISION_RUNS:-2}" -ge 2 ]; then
    log "provisioning again: must report changed=0"
    "${playbook[@]}" > "$OUT/provision-$ARCH-2.log" 2>&1 || { tail -40 "$OUT/provision-$ARCH-2.log"; die "second provisioning failed"; }
    grep -A3 'PLAY RECAP' "$OUT/provision-$ARCH-2.log"
    if grep -E '^(image|localhost) .*changed=[1-9]' "$OUT/provision-$ARCH-2.log"; then
        grep -B2 -E '^changed:' "$OUT/provision-$ARCH-2.log" | head -40
        die "the second run changed something: the playbook is not idempotent"
    fi
fi
rm -rf "$rootfs/root/.ansible" "$rootfs/tmp/"* "$src" 2>/dev/null || true
# resolv.conf: whatever configures the network (a DHCP client, systemd-networkd + resolved) writes it to /run.
ln -sfn ../run/resolv.conf "$rootfs/etc/resolv.conf"

# ---------------------------------------------------------------------------------------------- 4. test probe
# Inert unless the kernel command line or qemu's fw_cfg asks for it (image/probe/probe.sh --wanted).
install -D -m 0755 "$ROOT_DIR/image/probe/probe.sh" "$rootfs/usr/local/lib/edge-gateway-probe/probe.sh"
install -D -m 0644 "$ROOT_DIR/image/probe/edge-gateway-probe.service" \
    "$rootfs/etc/systemd/system/edge-gateway-probe.service"
ln -sfn ../edge-gateway-probe.service "$rootfs/etc/systemd/system/multi-user.target.wants/edge-gateway-probe.service"
# The data partition grows to the end of a larger card at the first boot (image/data/grow-data.sh).
install -D -m 0755 "$ROOT_DIR/image/data/grow-data.sh" "$rootfs/usr/local/lib/edge-gateway/grow-data.sh"
install -D -m 0644 "$ROOT_DIR/image/data/edge-gateway-grow-data.service" \
    "$rootfs/etc/systemd/system/edge-gateway-grow-data.service"
ln -sfn ../edge-gateway-grow-data.service \
    "$rootfs/etc/systemd/system/multi-user.target.wants/edge-gateway-grow-data.service"
printf 'VERSION=%s\nARCH=%s\n' "$IMAGE_VERSION" "$ARCH" > "$rootfs/etc/edge-gateway-release"
printf '%s\n' "$IMAGE_VERSION" > "$OUT/edge-gateway-$ARCH.version"

# ---------------------------------------------------------------------------------------------- 4b. A/B updates
# RAUC with two root slots (image/rauc/system.conf.in), the keyring bundles must chain to (image/rauc/keys.sh: the
# operator's, or a development key made once), and the health check that commits or rolls back a new slot.
# The boot loader backend: amd64 grub (grubenv on the EFI system partition), arm64 uboot (fw_printenv/fw_setenv on
# boot-state.env, the file /etc/fw_env.config names: image/rauc/fw_env.config).
if [ "$ARCH" = amd64 ]; then
    bootloader='bootloader=grub\ngrubenv=/boot/firmware/EFI/edge-gateway/grubenv'
else
    bootloader='bootloader=uboot'
    install -D -m 0644 "$ROOT_DIR/image/rauc/fw_env.config" "$rootfs/etc/fw_env.config"
fi
mapfile -t signing < <("$ROOT_DIR/image/rauc/keys.sh" "$OUT")
sed -e "s/@COMPATIBLE@/edge-gateway-$ARCH/" -e "s/@DISKID@/$DISKID/" -e "s|^@BOOTLOADER@\$|$bootloader|" \
    "$ROOT_DIR/image/rauc/system.conf.in" | install -D -m 0644 /dev/stdin "$rootfs/etc/rauc/system.conf"
grep -q '^bootloader=' "$rootfs/etc/rauc/system.conf" || die "no bootloader= in the image's /etc/rauc/system.conf"
install -D -m 0644 "${signing[2]}" "$rootfs/etc/rauc/keyring.pem"
install -D -m 0755 "$ROOT_DIR/image/rauc/health.sh" "$rootfs/usr/local/lib/edge-gateway/health.sh"
install -D -m 0644 "$ROOT_DIR/image/rauc/edge-gateway-health.service" \
    "$rootfs/etc/systemd/system/edge-gateway-health.service"
ln -sfn ../edge-gateway-health.service \
    "$rootfs/etc/systemd/system/multi-user.target.wants/edge-gateway-health.service"
install -d -m 0755 "$rootfs/var/lib/edge-gateway/update"  # RAUC's status, the health check's outcome (data)
# GRUB and U-Boot load the slot's kernel and initrd by these names (Debian's symlinks in /, made here when missing).
kernel=$(cd "$rootfs" && find boot -maxdepth 1 -name 'vmlinuz-*' | sort -V | tail -1)
initrd=$(cd "$rootfs" && find boot -maxdepth 1 -name 'initrd.img-*' | sort -V | tail -1)
[ -n "$kernel" ] && [ -n "$initrd" ] || die "no kernel/initrd in $rootfs/boot"
ln -sfn "$kernel" "$rootfs/vmlinuz"
ln -sfn "$initrd" "$rootfs/initrd.img"

# ---------------------------------------------------------------------------------------------- 5. partitions
stage partitions
parts="$OUT/parts-$ARCH"
rm -rf "$parts"
mkdir -p "$parts/boot" "$parts/data"
kernel=$(find "$rootfs/boot" -maxdepth 1 -name 'vmlinuz-*' | sort -V | tail -1)
initrd=$(find "$rootfs/boot" -maxdepth 1 -name 'initrd.img-*' | sort -V | tail -1)
[ -n "$kernel" ] && [ -n "$initrd" ] || die "no kernel/initrd in $rootfs/boot"
kver=${kernel##*/vmlinuz-}
if [ "$ARCH" = arm64 ]; then
    # The Raspberry Pi's: the firmware and the Pi device trees of the kernel (as Debian's raspi images have them),
    # config.txt starting U-Boot (u-boot-rpi's rpi_arm64: Pi 3 B/B+, 4 B, 400, CM4), cmdline.txt (the firmware puts
    # it into the device tree, where the boot script takes it from). Everyone's: the boot script, boot.scr
    # (image/rauc/boot.cmd, mkimage), and its A/B state, boot-state.env (mkenvimage: slot A first with 3 boots, slot
    # B empty until the first update, so 0), both found by U-Boot's distro boot on this partition (bootable).
    cp "$rootfs"/usr/lib/raspi-firmware/* "$parts/boot/"
    cp "$rootfs/usr/lib/linux-image-$kver"/broadcom/bcm*rpi*.dtb "$parts/boot/"
    cp "$rootfs/usr/lib/u-boot/rpi_arm64/u-boot.bin" "$parts/boot/u-boot.bin"
    cat > "$parts/boot/config.txt" <<CONFIG
# edge-gateway image (image/build.sh). Boards: Raspberry Pi 3 B/B+, 4 B, 400, CM4. The firmware starts U-Boot, whose
# boot script (boot.scr) picks the root slot A or B and boots the kernel of that slot.
[pi4]
# Enable the audio output, I2C and SPI interfaces on the GPIO header.
dtparam=audio=on
dtparam=i2c_arm=on
dtparam=spi=on
max_framebuffers=2
arm_boost=1

[all]
# Switch the CPU from ARMv7 into ARMv8 (aarch64) mode
arm_64bit=1
enable_uart=1
# the upstream device trees (bcm2837-rpi-3-b.dtb, bcm2711-rpi-4-b.dtb, ...), which U-Boot hands to Debian's kernel
upstream_kernel=1
kernel=u-boot.bin
CONFIG
    echo "console=tty0 console=ttyS1,115200 fsck.repair=yes net.ifnames=0 cma=64M" > "$parts/boot/cmdline.txt"
    mkimage -A arm64 -O linux -T script -C none -n "edge-gateway A/B boot" -d "$ROOT_DIR/image/rauc/boot.cmd" \
        "$parts/boot/boot.scr" >/dev/null
    printf 'BOOT_ORDER=A B\nBOOT_A_LEFT=3\nBOOT_B_LEFT=0\n' > "$parts/boot-state.txt"
    mkenvimage -s 0x4000 -o "$parts/boot/boot-state.env" "$parts/boot-state.txt"
    rm -f "$parts/boot-state.txt"
else
    # The EFI system partition: GRUB as the removable-media boot path (EFI/BOOT/BOOTX64.EFI: no NVRAM entry to
    # make), with an embedded configuration that reads EFI/edge-gateway/grub.cfg (the A/B selection) and its state,
    # grubenv: both slots' OK and TRY, slot A first and good, slot B empty until the first update.
    mkdir -p "$parts/boot/EFI/BOOT" "$parts/boot/EFI/edge-gateway"
    cp "$ROOT_DIR/image/rauc/embedded.cfg" "$rootfs/tmp/embedded.cfg"
    chroot "$rootfs" grub-mkstandalone -O x86_64-efi -o /tmp/BOOTX64.EFI \
        --modules="part_msdos fat ext2 linux normal configfile loadenv test echo search search_label regexp probe serial terminal" \
        --locales= --themes= --fonts= "boot/grub/grub.cfg=/tmp/embedded.cfg"
    mv "$rootfs/tmp/BOOTX64.EFI" "$parts/boot/EFI/BOOT/BOOTX64.EFI"
    rm -f "$rootfs/tmp/embedded.cfg"
    cp "$ROOT_DIR/image/rauc/grub.cfg" "$parts/boot/EFI/edge-gateway/grub.cfg"
    env=$parts/boot/EFI/edge-gateway/grubenv
    chroot "$rootfs" grub-editenv /tmp/grubenv create
    chroot "$rootfs" grub-editenv /tmp/grubenv set ORDER="A B" A_OK=1 A_TRY=0 B_OK=0 B_TRY=0
    mv "$rootfs/tmp/grubenv" "$env"
fi
# The boot partition's files stay in the root too (/boot); /boot/firmware and /var/lib/edge-gateway are mount points.
# firmware-bridge keeps no state, but systemd makes its StateDirectory= at each start unless it is there as it wants
# it (owner, 0750): on a read-only root it must be made now.
bridge_ids=$(awk -F: '$1 == "firmware-bridge" {print $3 ":" $4}' "$rootfs/etc/passwd")
[ -n "$bridge_ids" ] || die "no firmware-bridge user in the root"
install -d -m 0750 -o "${bridge_ids%:*}" -g "${bridge_ids#*:}" "$rootfs/var/lib/firmware-bridge"
find "$rootfs/boot/firmware" -mindepth 1 -delete
cp -a "$rootfs/var/lib/edge-gateway/." "$parts/data/"
# The data partition's top is the broker's StateDirectory (owned by it, so systemd never re-owns what is below) and
# 0751: firmware-bridge passes through it to its applied settings (README "Per-board settings").
gw_ids=$(awk -F: '$1 == "edge-gateway" {print $3 ":" $4}' "$rootfs/etc/passwd")
[ -n "$gw_ids" ] || die "no edge-gateway user in the root"
chown "$gw_ids" "$parts/data"
chmod 0751 "$parts/data"
find "$rootfs/var/lib/edge-gateway" -mindepth 1 -delete
used_mb=$(du -sm --apparent-size "$rootfs" | cut -f1)
root_mb=$IMAGE_ROOT_MB
[ $((used_mb * 12 / 10 + 64)) -le "$root_mb" ] || die "the root ($used_mb MiB) does not fit IMAGE_ROOT_MB=$root_mb MiB"
mkfs.ext4 -q -F -L eg-root -d "$rootfs" "$parts/root.ext4" "${root_mb}M"
rm -rf "$rootfs"  # the root partition holds it now; without the copy the build's peak is ~0.8 GiB lower
# RAUC writes this image into a slot whole; a fixed UUID would be the same in both slots, so leave it random.
mkfs.ext4 -q -F -L eg-data -d "$parts/data" "$parts/data.ext4" "${IMAGE_DATA_MB}M"
boot_mb=$(du -sm --apparent-size "$parts/boot" | cut -f1)
[ "$boot_mb" -lt $((IMAGE_BOOT_MB - 32)) ] || die "the boot files ($boot_mb MiB) do not fit $IMAGE_BOOT_MB MiB"
mkfs.vfat -F 32 -n EG-BOOT -C "$parts/boot.vfat" $((IMAGE_BOOT_MB * 1024)) >/dev/null
mcopy -i "$parts/boot.vfat" -s -p -Q "$parts/boot"/* ::/

# ---------------------------------------------------------------------------------------------- 6. disk image
stage disk
img="$OUT/edge-gateway-$ARCH.img"
rm -f "$img" "$img.bmap"
first=4   # MiB before the first partition (the firmware and the SD card's erase blocks like 4 MiB alignment)
slots=2  # the A/B root slots
data_at=$((first + IMAGE_BOOT_MB + slots * root_mb))
total=$((data_at + IMAGE_DATA_MB))
truncate -s "${total}M" "$img"
# MBR (the Raspberry Pi 3 boots from MBR only; EFI boots from MBR too, partition type ef): 1 boot, bootable (U-Boot's
# distro boot looks for boot.scr on the bootable partitions); then the root slots and the data partition, Linux.
boot_type=c
[ "$ARCH" = amd64 ] && boot_type=ef
{
    printf 'label: dos\nlabel-id: 0x%s\nunit: sectors\n' "$DISKID"
    printf 'start=%d, size=%d, type=%s, bootable\n' $((first * 2048)) $((IMAGE_BOOT_MB * 2048)) "$boot_type"
    for n in $(seq "$slots"); do
        printf 'start=%d, size=%d, type=83\n' $(((first + IMAGE_BOOT_MB + (n - 1) * root_mb) * 2048)) $((root_mb * 2048))
    done
    printf 'start=%d, size=%d, type=83\n' $((data_at * 2048)) $((IMAGE_DATA_MB * 2048))
} | sfdisk --quiet --no-reread --no-tell-kernel "$img"
dd if="$parts/boot.vfat" of="$img" bs=1M seek=$first conv=notrunc,sparse status=none
dd if="$parts/root.ext4" of="$img" bs=1M seek=$((first + IMAGE_BOOT_MB)) conv=notrunc,sparse status=none
dd if="$parts/data.ext4" of="$img" bs=1M seek=$data_at conv=notrunc,sparse status=none
mv "$parts/root.ext4" "$OUT/edge-gateway-$ARCH-root.ext4"
rm -rf "$parts"
bmaptool -q create -o "$img.bmap" "$img"
sfdisk --list "$img" | sed -n '/^Device/,$p'
stage done
log "image: $img (${total} MiB, $(du -sm "$img" | cut -f1) MiB allocated; root ${root_mb} MiB x $slots with $used_mb" \
    "MiB used, data ${IMAGE_DATA_MB} MiB), kernel $kver, version $IMAGE_VERSION, $((SECONDS - start)) s in all"
exit
}
