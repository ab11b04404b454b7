# edge-gateway A/B boot selection for U-Boot (image/rauc/boot.cmd -> boot.scr on the boot partition, made with
# mkimage by image/build.sh). U-Boot's distro boot finds boot.scr on the bootable partition (the boot partition,
# FAT, EG-BOOT) and runs it with devtype, devnum and distro_bootpart set to that partition: Debian's u-boot-qemu
# (qemu_arm64) on generic arm64 and under qemu, u-boot-rpi (rpi_arm64) started by the Raspberry Pi firmware.
#
# RAUC's uboot backend keeps the state in three variables: BOOT_ORDER (the slots by preference, the one RAUC installed
# last first), BOOT_A_LEFT and BOOT_B_LEFT (boots a slot has left; `rauc install` and `rauc status mark-good` set 3,
# `rauc status mark-bad` and the start of an install 0). They live in boot-state.env on this partition, in U-Boot's
# binary environment format (a CRC32, then name=value strings), which fw_printenv/fw_setenv read and write from
# Linux (/etc/fw_env.config names the file): not in U-Boot's own environment, which is in flash on qemu_arm64 and in
# uboot.env on the Pi, where a saveenv would store every variable and a file with only these three would replace the
# board's boot commands. Each boot takes the first slot of BOOT_ORDER with boots left, counts the boot down and
# writes the file back before it loads the kernel: a slot whose system never gets as far as
# edge-gateway-health.service marking it good (a kernel that panics, a root that does not mount, a hang the watchdog
# resets) has used its 3 boots after 3 tries, and the next boot takes the other slot. With no slot left, both get 3
# again and the first of BOOT_ORDER boots (better a system that boots than none).
#
# The kernel and initrd come from the slot itself (/vmlinuz, /initrd.img: Debian's links to the root's kernel), so an
# update brings its kernel. The root is that partition by PARTUUID, and rauc.slot= tells RAUC which slot booted.
# On the Raspberry Pi the firmware's command line (cmdline.txt, in the device tree it hands over) is kept and the
# root and slot are added to it; elsewhere the device tree's stdout-path is the console.

test -n "${distro_bootpart}" || setenv distro_bootpart 1
setenv eg_bootdev "${devtype} ${devnum}:${distro_bootpart}"
setenv BOOT_ORDER
setenv BOOT_A_LEFT
setenv BOOT_B_LEFT
if load ${devtype} ${devnum}:${distro_bootpart} ${kernel_addr_r} boot-state.env && env import -c ${kernel_addr_r} 0x4000 BOOT_ORDER BOOT_A_LEFT BOOT_B_LEFT; then
    echo "edge-gateway: boot state from boot-state.env on ${eg_bootdev}"
else
    echo "edge-gateway: no valid boot-state.env on ${eg_bootdev}: the defaults"
fi
test -n "${BOOT_ORDER}" || setenv BOOT_ORDER "A B"
test -n "${BOOT_A_LEFT}" || setenv BOOT_A_LEFT 3
test -n "${BOOT_B_LEFT}" || setenv BOOT_B_LEFT 3

# eg_pick: the first slot of BOOT_ORDER with boots left, its count down by one (setexpr counts in hex: 3, 2, 1, 0)
setenv eg_pick 'for BOOT_SLOT in "${BOOT_ORDER}"; do if test -z "${eg_slot}" && test "${BOOT_SLOT}" = A && test ${BOOT_A_LEFT} -gt 0; then setexpr BOOT_A_LEFT ${BOOT_A_LEFT} - 1; setenv eg_slot A; setenv eg_part 2; fi; if test -z "${eg_slot}" && test "${BOOT_SLOT}" = B && test ${BOOT_B_LEFT} -gt 0; then setexpr BOOT_B_LEFT ${BOOT_B_LEFT} - 1; setenv eg_slot B; setenv eg_part 3; fi; done'
# eg_save: the three variables back into boot-state.env (same size, same place: U-Boot's FAT writes it over)
setenv eg_save 'env export -c -s 0x4000 ${kernel_addr_r} BOOT_ORDER BOOT_A_LEFT BOOT_B_LEFT && fatwrite ${devtype} ${devnum}:${distro_bootpart} ${kernel_addr_r} boot-state.env 0x4000'
setenv eg_slot
run eg_pick
if test -z "${eg_slot}"; then
    echo "edge-gateway: no slot with boots left (BOOT_ORDER=${BOOT_ORDER}): 3 each again, the first of BOOT_ORDER boots"
    setenv BOOT_A_LEFT 3
    setenv BOOT_B_LEFT 3
    run eg_pick
fi
if run eg_save; then
    true
else
    echo "edge-gateway: could not write boot-state.env: this boot is not counted"
fi
echo "edge-gateway: booting slot ${eg_slot} (BOOT_ORDER=${BOOT_ORDER} BOOT_A_LEFT=${BOOT_A_LEFT} BOOT_B_LEFT=${BOOT_B_LEFT})"

# Memory: the initrd 128 MiB above the kernel (Debian's arm64 vmlinuz is an uncompressed Image of about 30 MiB that
# booti may move up to the next 2 MiB), and 192 MiB above it the buffer where booti would unpack a compressed one
# (Image.gz): the same layout on qemu's virt board (RAM from 0x40000000) and on the Pi (from 0), 512 MiB or more.
setexpr ramdisk_addr_r ${kernel_addr_r} + 0x8000000
setexpr kernel_comp_addr_r ${kernel_addr_r} + 0xc000000
part uuid ${devtype} ${devnum}:${eg_part} eg_partuuid
if load ${devtype} ${devnum}:${eg_part} ${kernel_addr_r} /vmlinuz; then
    setenv kernel_comp_size ${filesize}
    if load ${devtype} ${devnum}:${eg_part} ${ramdisk_addr_r} /initrd.img; then
        setenv eg_initrd_size ${filesize}
        setenv eg_cmdline
        if test -n "${fdt_addr}" && fdt addr ${fdt_addr} && fdt get value eg_cmdline /chosen bootargs; then
            true
        fi
        setenv bootargs "${eg_cmdline} root=PARTUUID=${eg_partuuid} ro rootwait panic=10 rauc.slot=${eg_slot}"
        echo "edge-gateway: ${bootargs}"
        booti ${kernel_addr_r} ${ramdisk_addr_r}:${eg_initrd_size} ${fdt_addr}
    fi
fi
# Only a slot without a kernel that boots gets here (an empty or broken slot): it has no boots left, and the board
# starts again (a reset), which takes the next slot.
echo "edge-gateway: slot ${eg_slot} did not boot (no /vmlinuz or /initrd.img on ${devtype} ${devnum}:${eg_part}?): marked bad"
setenv BOOT_${eg_slot}_LEFT 0
run eg_save
reset
