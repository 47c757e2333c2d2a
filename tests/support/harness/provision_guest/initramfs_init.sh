#!/bin/busybox sh
# /init of the provisioning test VM's initramfs (tests/support/harness/provision_vm.py builds
# it: busybox, mg-nbd-client compiled from nbd_client.c, the kernel's modules).
#
# What a production image's initramfs does for metalguard's boot chain
# (docs/provisioning.md): load the NIC and nbd modules, DHCP, attach the root volume named
# by `nbdroot=HOST,PORT,NAME` on the kernel command line (Debian's nbd-client initramfs
# syntax) to /dev/nbd0, mount it on /newroot and switch_root to its /sbin/init.
# Every line it prints starts with "mg-initramfs:"; on a failure it says why and resets
# the machine (QEMU runs with -no-reboot: the VM ends and the test reads the console).
/bin/busybox mkdir -p /proc /sys /dev /newroot /bin /sbin /run
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

say() { echo "mg-initramfs: $*"; }
up() { say "$1 at $(cut -d' ' -f1 /proc/uptime)s"; }
fail() {
	say "FAIL $*"
	sleep 1
	reboot -f
}

# find_iface: IFACE=the first network interface but lo (false while there is none).
find_iface() {
	for dev in /sys/class/net/*; do
		name=${dev##*/}
		[ "$name" = lo ] || {
			IFACE=$name
			return 0
		}
	done
	return 1
}

up init
IFACE=""
while read -r line; do
	# shellcheck disable=SC2086 # a module and its parameters, word-split on purpose
	insmod /lib/modules/$line || fail "insmod $line"
	if [ -z "$IFACE" ] && find_iface; then
		ip link set "$IFACE" up || fail "ip link set $IFACE up" # links while the rest loads
	fi
done </lib/modules/order
up modules
[ -n "$IFACE" ] || fail "no network interface (is the NIC's module in the initramfs?)"

NBDROOT=""
for word in $(cat /proc/cmdline); do
	case "$word" in
	nbdroot=*) NBDROOT=${word#nbdroot=} ;;
	esac
done
[ -n "$NBDROOT" ] || fail "no nbdroot=HOST,PORT,NAME on the kernel command line"
IFS=, read -r NBD_HOST NBD_PORT NBD_NAME <<EOF
$NBDROOT
EOF
[ -n "$NBD_HOST" ] && [ -n "$NBD_PORT" ] && [ -n "$NBD_NAME" ] ||
	fail "nbdroot= wants HOST,PORT,NAME"

ip link set lo up
udhcpc -i "$IFACE" -s /bin/dhcp-script -q -f -n -t 20 -T 1 >/dev/null 2>&1 ||
	fail "no DHCP lease on $IFACE"
up "dhcp $IFACE $(ip -4 -o addr show dev "$IFACE" | awk '{print $4}')"

mg-nbd-client "$NBD_HOST" "$NBD_PORT" "$NBD_NAME" /dev/nbd0 ||
	fail "cannot attach the root volume from $NBD_HOST:$NBD_PORT"
up "nbd attached"
mount -t ext4 -o rw /dev/nbd0 /newroot || fail "cannot mount /dev/nbd0"
[ -x /newroot/sbin/init ] || fail "the root volume has no /sbin/init"
up "root mounted"

for fs in /dev /proc /sys; do
	if [ -d "/newroot$fs" ]; then
		mount --move "$fs" "/newroot$fs"
	else
		umount "$fs"
	fi
done
exec switch_root /newroot /sbin/init
