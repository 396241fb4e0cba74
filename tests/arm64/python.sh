#!/bin/sh
# The ARM64 rootfs's python3, emulated by qemu-aarch64-static:
#
#   tests/arm64/python.sh ROOTFS BINDS ARGS...
#
# BINDS: colon-separated host folders made visible inside at the same paths ("" for none), so a
# device reads its data and writes its cache where the host test looks. The chroot lives in a
# private mount namespace (unshare --mount): its /proc, /dev and BINDS mounts vanish with
# the process and nothing leaks into the host's mount table. The network is the host's: the
# device reaches the host's broker on 127.0.0.1. No binfmt_misc handler is needed (qemu is named),
# and the environment is clean (the host's PIP_*, PYTHONPATH name x86 paths).
# Each step execs the next: the caller's process id ends up being the emulated python, so a
# SIGTERM stops the device and wait4 reports its CPU time.
# The host's /sys is not mounted: ONNX Runtime's cpuinfo reads the x86 CPU topology there and the
# emulated process crashes (SIGSEGV); without it cpuinfo only warns that it cannot detect the CPU.
set -eu
ROOTFS=$(cd "${1:?usage: python.sh ROOTFS BINDS ARGS...}" && pwd)
BINDS=$2
shift 2
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
exec $SUDO env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PYTHONUNBUFFERED=1 unshare --mount sh -c '
  root=$1 binds=$2; shift 2
  mount --bind /proc "$root/proc" && mount --rbind /dev "$root/dev"
  IFS=:
  for dir in $binds; do mkdir -p "$root$dir" && mount --bind "$dir" "$root$dir"; done
  exec chroot "$root" /usr/bin/qemu-aarch64-static /usr/bin/python3 "$@"' sh "$ROOTFS" "$BINDS" "$@"
