#!/bin/busybox sh
# /sbin/init of the provisioning test image (tests/support/harness/provision_vm.py puts it,
# busybox and an /etc/os-release in the image's directory; the registry makes the image
# with mke2fs -d).  It runs on the tenant's volume, after the initramfs's switch_root:
#
# 1. fetches the instance's user data from `mg.userdata=URL` (kernel command line) and
#    runs it with sh (its output and exit status are kept);
# 2. syncs (what the user data wrote is on the volume before anyone is told);
# 3. posts the ready report to `mg.ready=URL`: a JSON object of strings (boot_id, kernel,
#    instance, image, userdata_rc, output), retried until the boot server takes it;
# 4. stays up until the machine is powered off.
# Every line it prints starts with "mg-image:".
export PATH=/bin:/sbin
[ -r /proc/cmdline ] || mount -t proc proc /proc
[ -d /sys/class ] || mount -t sysfs sys /sys
mount -t tmpfs -o mode=0755 run /run
mkdir -p /run/tmp

say() { echo "mg-image: $*"; }
up() { say "$1 at $(cut -d' ' -f1 /proc/uptime)s"; }

READY="" USERDATA="" INSTANCE=""
for word in $(cat /proc/cmdline); do
	case "$word" in
	mg.ready=*) READY=${word#mg.ready=} ;;
	mg.userdata=*) USERDATA=${word#mg.userdata=} ;;
	mg.instance=*) INSTANCE=${word#mg.instance=} ;;
	esac
done
up "init of instance ${INSTANCE:-?}"

# json STRING: STRING as a JSON string literal (quotes, backslashes, control characters).
json() {
	printf '%s' "$1" | tr -d '\000-\010\013\014\016-\037' | awk '
		BEGIN { ORS = ""; print "\"" }
		{
			gsub(/\\/, "\\\\"); gsub(/"/, "\\\""); gsub(/\t/, "\\t"); gsub(/\r/, "\\r")
			if (NR > 1) print "\\n"
			print
		}
		END { print "\"" }'
}

RC=""
: >/run/output
if [ -n "$USERDATA" ]; then
	tries=0
	until wget -q -O /run/userdata "$USERDATA"; do
		tries=$((tries + 1))
		[ "$tries" -lt 20 ] || break
		sleep 1
	done
	if [ -f /run/userdata ]; then
		(cd / && sh /run/userdata) >/run/output 2>&1
		RC=$?
		up "user data ran (exit $RC)"
	else
		say "could not fetch the user data from $USERDATA"
		RC=fetch-failed
	fi
fi
sync
up synced

IMAGE=$(. /etc/os-release 2>/dev/null && echo "${MG_IMAGE:-$ID}")
BODY="{\"boot_id\": $(json "$(cat /proc/sys/kernel/random/boot_id)"),"
BODY="$BODY \"kernel\": $(json "$(uname -r)"), \"instance\": $(json "$INSTANCE"),"
BODY="$BODY \"image\": $(json "$IMAGE"), \"userdata_rc\": $(json "$RC"),"
BODY="$BODY \"output\": $(json "$(tail -c 4096 /run/output)")}"
if [ -n "$READY" ]; then
	tries=0
	until wget -q -O /run/ready.out --header "Content-Type: application/json" \
		--post-data "$BODY" "$READY"; do
		tries=$((tries + 1))
		if [ "$tries" -ge 30 ]; then
			say "the boot server did not take the ready report"
			break
		fi
		sleep 1
	done
	[ "$tries" -lt 30 ] && up "ready reported"
else
	say "no mg.ready= on the kernel command line: nobody to tell"
fi

while :; do
	sleep 3600
done
