#!/bin/sh
# udhcpc's event script in the provisioning VM's initramfs: configure the lease.
# shellcheck disable=SC2154 # udhcpc sets interface, ip, mask, router
case "$1" in
deconfig)
	ip -4 addr flush dev "$interface"
	ip link set "$interface" up
	;;
bound | renew)
	ip -4 addr flush dev "$interface"
	ip addr add "$ip/${mask:-24}" dev "$interface"
	if [ -n "$router" ]; then
		ip route add default via "${router%% *}" dev "$interface"
	fi
	;;
esac
exit 0
