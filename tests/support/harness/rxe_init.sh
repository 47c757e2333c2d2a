#!/bin/busybox sh
# /init of the Soft-RoCE test VM (tests/support/harness/rxe_vm.py builds the initramfs).
#
# Loads the modules listed in /lib/modules/order, makes rxe0 on a dummy netdev (no NIC:
# all traffic stays in the guest), and writes to the second serial port (/dev/ttyS1):
#   @@STEP <name>            a setup step done (the last: "rxe0 gid=<n>")
#   @@FAIL <what>            a step failed (before rxe0 is up the host skips the test)
#   @@RC <what> <n>...       exit statuses
#   @@TIME <step> <s>        the guest's uptime after a step (where the time goes)
#   @@ALIVE <yes|no>         whether the traffic still ran after the "during" reading
#   @@BEGIN <reading> / per file: @@F <path below rxe0/>, |<line>... / @@END <reading>
#   @@DONE
# Readings: "idle" (device up, no traffic), "after" (after a pingpong of RXE_ITERS
# round trips), "during" (while an endless pingpong runs).  Every wait has a deadline.
/bin/busybox mkdir -p /proc /sys /dev /tmp /bin
/bin/busybox --install -s /bin
export PATH=/bin LD_LIBRARY_PATH=/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
exec 3>/dev/ttyS1
ITERS=${RXE_ITERS:-400}
DEV=/sys/class/infiniband/rxe0
P=$DEV/ports/1

say() { echo "@@$*" >&3; }
up() { say "TIME $1 $(cut -d" " -f1 /proc/uptime)"; }
bye() {
	say DONE
	sync
	reboot -f # QEMU runs with -no-reboot: the reset ends it
}
fail() { say "FAIL $*"; bye; }

# until_true TRIES CMD...: run CMD every 20 ms until it succeeds, at most TRIES times.
until_true() {
	n=$1
	shift
	while ! "$@"; do
		n=$((n - 1))
		[ "$n" -gt 0 ] || return 1
		usleep 20000
	done
}

say "STEP init"
up init
while read -r m; do
	insmod "/lib/modules/$m" || fail "insmod $m"
done </lib/modules/order
say "STEP modules"
up modules

ip link set lo up || fail "ip link set lo up"
ip link add dum0 type dummy || fail "ip link add dum0 type dummy"
ip addr add 10.9.0.1/24 dev dum0 || fail "ip addr add"
ip link set dum0 up || fail "ip link set dum0 up"
rdma link add rxe0 type rxe netdev dum0 || fail "rdma link add rxe0 type rxe netdev dum0"
active() { [ "$(cat $P/state 2>/dev/null)" = "4: ACTIVE" ]; }
until_true 500 active || fail "rxe0 port 1 not ACTIVE after 10 s: $(cat $P/state)"

# The GID of dum0's IPv4 address (RoCE v2).
GID=""
for g in 0 1 2 3 4 5 6 7; do
	[ "$(cat $P/gids/$g 2>/dev/null)" = "0000:0000:0000:0000:0000:ffff:0a09:0001" ] && GID=$g && break
done
[ -n "$GID" ] || fail "no IPv4 GID for 10.9.0.1 on rxe0"
say "STEP rxe0 gid=$GID"

# snap NAME: send the files the rdma collector reads, each as "@@F <path>" and its lines
# as "|<line>" (shell builtins only: a fork per file is slow under emulation).
snap() {
	cd "$DEV" || fail "cd $DEV"
	say "BEGIN $1"
	for f in * hw_counters/* ports/*/* ports/*/counters/* ports/*/counters_ext/* \
		ports/*/hw_counters/* ports/*/gid_attrs/ndevs/0 ports/*/gid_attrs/types/0 \
		ports/*/gids/0; do
		[ -f "$f" ] && [ -r "$f" ] || continue
		say "F $f"
		while IFS= read -r l || [ -n "$l" ]; do printf '|%s\n' "$l"; done <"$f" >&3
	done
	say "END $1"
	cd /
}

# listening PORT: a TCP socket listens on PORT (the pingpong server's exchange socket).
listening() {
	awk -v p=":$(printf %04X "$1")" '$2 ~ (p "$") && $4 == "0A" { f = 1 } END { exit !f }' \
		/proc/net/tcp /proc/net/tcp6 2>/dev/null
}
sent() { cat $P/hw_counters/sent_pkts; }
PP="ibv_rc_pingpong -d rxe0 -i 1 -g $GID -e"

up rxe
snap idle
up idle

timeout 60 $PP -p 18515 -n "$ITERS" >/tmp/server1.log 2>&1 &
server=$!
until_true 500 listening 18515 || fail "pingpong server not listening"
timeout 60 $PP -p 18515 -n "$ITERS" 127.0.0.1 >/tmp/client1.log 2>&1
client_rc=$?
wait $server
server_rc=$?
cat /tmp/server1.log /tmp/client1.log
say "RC pingpong $client_rc $server_rc"
up pingpong
snap after
up after

base=$(sent)
timeout 120 $PP -p 18516 -n 1000000000 >/tmp/server2.log 2>&1 &
server=$!
until_true 500 listening 18516 || fail "second pingpong server not listening"
timeout 120 $PP -p 18516 -n 1000000000 127.0.0.1 >/tmp/client2.log 2>&1 &
client=$!
moving() { [ "$(sent)" -gt $((base + 100)) ]; }
until_true 500 moving || say "RC moving 1"
up moving
snap during
up during
if kill -0 $client 2>/dev/null && kill -0 $server 2>/dev/null; then
	say "ALIVE yes"
else
	say "ALIVE no"
fi
kill $client $server 2>/dev/null
wait
cat /tmp/server2.log /tmp/client2.log
up end
bye
