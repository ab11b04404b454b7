#!/bin/sh
# edge-gateway-grow-data.service: the data partition (/var/lib/edge-gateway, the last partition of the disk) grows
# to the end of the card or disk it was written to, and its ext4 file system with it, at the first boot on a card
# larger than the image (and on any later boot that finds room behind it: a card copied to a larger one). Without
# this a 32 GB card would keep the image's IMAGE_DATA_MB for the store and for update bundles.
# Online: the partition table entry is rewritten (sfdisk, MBR), the kernel told the new size (resizepart) and the
# mounted file system grown (resize2fs); the store and what it holds are not touched. Every step is checked before
# the next one: a failure leaves the partition as it was, logged, and the gateway starts as usual.
set -u
PATH=/usr/sbin:/usr/bin:/sbin:/bin
DATA=${DATA_MOUNT:-/var/lib/edge-gateway}
say() { echo "edge-gateway-grow-data: $*"; }

part=$(findmnt -no SOURCE "$DATA") || { say "$DATA is not mounted: nothing to grow"; exit 0; }
name=$(basename "$(readlink -f "$part")")
sys=/sys/class/block/$name
[ -r "$sys/partition" ] || { say "$part is not a partition: nothing to grow"; exit 0; }
disk=$(basename "$(readlink -f "$sys/..")")
number=$(cat "$sys/partition")
start=$(cat "$sys/start")
size=$(cat "$sys/size")
total=$(cat "/sys/class/block/$disk/size")
for other in /sys/class/block/"$disk"/*/start; do
    if [ "$(cat "$other")" -gt "$start" ]; then
        say "$part is not the last partition of /dev/$disk: left as it is"; exit 0
    fi
done
# sizes in 512-byte sectors; the end is kept 1 MiB aligned, like the image's own partitions
new=$(( (total - start) / 2048 * 2048 ))
if [ "$new" -le $((size + 2048)) ]; then
    # less than 1 MiB to gain: the usual boot, unless an earlier boot grew the partition but not its file system
    fs_bytes=$(tune2fs -l "$part" 2>/dev/null | awk -F: '/^Block count/ {n=$2} /^Block size/ {b=$2} END {printf "%.0f", n*b}')
    if [ -n "$fs_bytes" ] && [ "$fs_bytes" -lt $(( (size - 2048) * 512 )) ]; then
        resize2fs "$part" >/run/grow-data.log 2>&1 || say "resize2fs failed: $(tr '\n' ' ' < /run/grow-data.log)"
    fi
    exit 0
fi
say "growing $part (partition $number of /dev/$disk) from $((size / 2048)) MiB to $((new / 2048)) MiB"
if ! echo "$start,$new" | sfdisk --no-reread --no-tell-kernel --quiet -N "$number" "/dev/$disk" \
        >/run/grow-data.log 2>&1; then
    say "sfdisk failed, partition left as it is: $(tr '\n' ' ' < /run/grow-data.log)"; exit 1
fi
if ! resizepart "/dev/$disk" "$number" "$new" >/run/grow-data.log 2>&1; then
    say "the kernel did not take the new size (the next boot grows the file system): $(tr '\n' ' ' < /run/grow-data.log)"
    exit 1
fi
if ! resize2fs "$part" >/run/grow-data.log 2>&1; then
    say "resize2fs failed: $(tr '\n' ' ' < /run/grow-data.log)"; exit 1
fi
say "$DATA now has $(df -h --output=size "$DATA" | tail -1 | tr -d ' ') ($(df -h --output=avail "$DATA" | tail -1 | tr -d ' ') free)"
