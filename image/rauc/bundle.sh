#!/usr/bin/env bash
# `make bundle [ARCH=amd64]`: a signed RAUC update bundle of the root the image has:
#   build/appliance/edge-gateway-VERSION-ARCH.raucb
# from build/appliance/edge-gateway-ARCH-root.ext4 (written by `make image`, VERSION in edge-gateway-ARCH.version),
# for the slots of image/rauc/system.conf.in ("compatible" edge-gateway-ARCH), in RAUC's verity format (a squashfs
# with a dm-verity hash tree, so a gateway checks every block it reads), signed with image/rauc/keys.sh's key.
#
#   bundle.sh [--arch ARCH] [--root FILE.ext4] [--version V] [--compatible C] [--out FILE.raucb]
# --root/--version/--compatible/--out make other bundles from other roots (the update test's).
set -euo pipefail
ROOT_DIR=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${IMAGE_OUT:-$ROOT_DIR/build/appliance}
arch=${IMAGE_ARCH:-amd64}
root="" version="" compatible="" bundle=""
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) arch=$2; shift 2 ;;
        --root) root=$2; shift 2 ;;
        --version) version=$2; shift 2 ;;
        --compatible) compatible=$2; shift 2 ;;
        --out) bundle=$2; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "bundle.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
    esac
done
command -v rauc >/dev/null || { echo "bundle.sh: rauc is missing: make image-deps" >&2; exit 1; }
command -v mksquashfs >/dev/null || { echo "bundle.sh: mksquashfs is missing: make image-deps" >&2; exit 1; }
root=${root:-$OUT/edge-gateway-$arch-root.ext4}
[ -f "$root" ] || { echo "bundle.sh: $root is missing: make image ARCH=$arch" >&2; exit 1; }
version=${version:-$(cat "$OUT/edge-gateway-$arch.version" 2>/dev/null || true)}
[ -n "$version" ] || { echo "bundle.sh: no version: $OUT/edge-gateway-$arch.version is missing (make image)" >&2; exit 1; }
compatible=${compatible:-edge-gateway-$arch}
bundle=${bundle:-$OUT/edge-gateway-$version-$arch.raucb}
mapfile -t keys < <("$ROOT_DIR/image/rauc/keys.sh" "$OUT")
content=$(mktemp -d "$OUT/bundle-content.XXXXXX")
trap 'rm -rf "$content"' EXIT
# a hard link where the file system allows it: the root image is 2 GiB
ln "$root" "$content/rootfs.ext4" 2>/dev/null || cp --sparse=always "$root" "$content/rootfs.ext4"
cat > "$content/manifest.raucm" <<MANIFEST
[update]
compatible=$compatible
version=$version
description=edge-gateway $version ($arch)

[bundle]
format=verity

[image.rootfs]
filename=rootfs.ext4
MANIFEST
rm -f "$bundle"
# zstd: about as small as mksquashfs's default gzip and several times faster to make; Debian's kernel reads it
rauc bundle --cert="${keys[0]}" --key="${keys[1]}" --keyring="${keys[2]}" \
    --mksquashfs-args="-comp zstd -Xcompression-level 6" "$content" "$bundle" >&2
echo "bundle: $bundle ($(du -m "$bundle" | cut -f1) MiB, version $version, compatible $compatible)" >&2
echo "$bundle"
