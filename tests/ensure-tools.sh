#!/usr/bin/env bash
# Installs the system tools the test suite exercises, when missing and when we can
# (root with apt-get).  Tests that still lack a tool skip with the reason printed.
set -u
want=()
command -v smartctl >/dev/null 2>&1 || want+=(smartmontools)

command -v systemd-analyze >/dev/null 2>&1 || want+=(systemd)
command -v ip >/dev/null 2>&1 || want+=(iproute2)
{ ldconfig -p 2>/dev/null | grep -q 'libudev\.so\.1 '; } || want+=(libudev1)  # pyudev
command -v ethtool >/dev/null 2>&1 || want+=(ethtool)
command -v ipmitool >/dev/null 2>&1 || want+=(ipmitool)  # bmc ipmi collector
command -v ipmi_sim >/dev/null 2>&1 || want+=(openipmi)  # BMC simulator (ipmi_sim, sdrcomp)
command -v ipmi-sensors >/dev/null 2>&1 || want+=(freeipmi-tools)  # bmc ipmi, freeipmi profile
command -v openssl >/dev/null 2>&1 || want+=(openssl)  # redfish emulator certificate
command -v slurmctld >/dev/null 2>&1 || want+=(slurm-wlm)  # real one-node Slurm (slurm bridge)
command -v munged >/dev/null 2>&1 || want+=(munge)  # Slurm's authentication
command -v chromium >/dev/null 2>&1 || want+=(chromium)  # the dashboard's browser test
[ -x /usr/bin/chromedriver ] || want+=(chromium-driver)  # selenium drives chromium with it
# The Soft-RoCE VM test (tests/support/harness/rxe_vm.py): QEMU, and what its initramfs holds.
command -v qemu-system-x86_64 >/dev/null 2>&1 || want+=(qemu-system-x86)
command -v busybox >/dev/null 2>&1 || want+=(busybox-static)
command -v rdma >/dev/null 2>&1 || want+=(iproute2)
command -v ibv_rc_pingpong >/dev/null 2>&1 || want+=(ibverbs-utils)
[ -f /etc/libibverbs.d/rxe.driver ] || want+=(ibverbs-providers)  # librxe
# The dataset cache's FUSE mount (libfuse 3 for mfusepy, fusermount3 to unmount).
command -v fusermount3 >/dev/null 2>&1 || want+=(fuse3)
{ ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so\.3 '; } || want+=(libfuse3-3)
# Provisioning (docs/provisioning.md): qcow2 overlays, the NBD export, the Redfish BMC.
command -v qemu-img >/dev/null 2>&1 || want+=(qemu-utils)
command -v qemu-storage-daemon >/dev/null 2>&1 || want+=(qemu-system-common)  # NBD exports
command -v mke2fs >/dev/null 2>&1 || want+=(e2fsprogs)
[ -d /usr/lib/ipxe/qemu ] || want+=(ipxe-qemu)
# The provisioning VM (tests/support/harness/provision_vm.py): its static NBD client, and the
# host-side check of a tenant's volume (debugfs is in e2fsprogs).
command -v gcc >/dev/null 2>&1 || want+=(gcc)
[ -n "$(find /usr/lib -maxdepth 3 -name libc.a 2>/dev/null | head -n 1)" ] || want+=(libc6-dev)
[ ${#want[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-tools: not root or no apt-get; tests needing ${want[*]} will skip" >&2
  exit 0
fi
echo "ensure-tools: installing ${want[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null 2>&1; then
  apt-get update -q >/dev/null 2>&1 || true
  apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null 2>&1 \
    || echo "ensure-tools: could not install ${want[*]}; tests needing them will skip" >&2
fi
exit 0
