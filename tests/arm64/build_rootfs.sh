#!/bin/sh
# An aarch64 Debian userland with fedfleet[device] installed, for `make test-arm64`
# (tests/test_arm64_fleet.py runs ARM64 devices from it under qemu-user).
#
#   tests/arm64/build_rootfs.sh DIR HOST_PIP
#
# Idempotent, and needs nothing but Debian's and PyPI's registries:
# * mmdebstrap and qemu-user-static come from apt-get when missing;
# * DIR/rootfs is Debian bookworm arm64 (python3 3.11 and the C/C++ runtimes the wheels link
#   against), built once by `mmdebstrap --variant=extract`: packages are only unpacked, so no
#   arm64 maintainer script has to run on this x86 host and no binfmt_misc handler is needed
#   (registering one would change the whole host's kernel);
# * the wheels of fedfleet[device] for cp311 / manylinux aarch64 are downloaded by the host's pip
#   into DIR/wheels (pip under emulation would take minutes), once per pyproject.toml;
# * the rootfs's own pip installs them with --no-index, under qemu-aarch64-static; the fedfleet
#   wheel itself is rebuilt from this tree and reinstalled on every run, so the ARM64 devices run
#   the code under test.
set -eu
DIR=${1:?usage: build_rootfs.sh DIR HOST_PIP}
HOST_PIP=${2:?usage: build_rootfs.sh DIR HOST_PIP}
ROOTFS=$DIR/rootfs
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
SUITE=bookworm
PACKAGES=python3,python3-pip,libstdc++6,libgomp1,ca-certificates

if ! command -v mmdebstrap >/dev/null 2>&1 || [ ! -x /usr/bin/qemu-aarch64-static ]; then
  echo "arm64: installing mmdebstrap and qemu-user-static"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap qemu-user-static >/dev/null
fi

if [ ! -f "$ROOTFS/.fedfleet-extracted" ]; then
  echo "arm64: unpacking Debian $SUITE arm64 ($PACKAGES) into $ROOTFS"
  $SUDO rm -rf "$ROOTFS.partial"
  mkdir -p "$DIR"
  $SUDO mmdebstrap --quiet --mode=root --variant=extract --arch=arm64 --include=$PACKAGES \
      $SUITE "$ROOTFS.partial" http://deb.debian.org/debian
  $SUDO mkdir -p "$ROOTFS.partial/proc" "$ROOTFS.partial/dev" "$ROOTFS.partial/sys" "$ROOTFS.partial/tmp" "$ROOTFS.partial/wheels"
  $SUDO chmod 1777 "$ROOTFS.partial/tmp"
  $SUDO touch "$ROOTFS.partial/.fedfleet-extracted"
  $SUDO rm -rf "$ROOTFS" && $SUDO mv "$ROOTFS.partial" "$ROOTFS"
fi
$SUDO cp -f /usr/bin/qemu-aarch64-static "$ROOTFS/usr/bin/qemu-aarch64-static"

PYVER=$(ls "$ROOTFS/usr/bin" | sed -n 's/^python3\.\([0-9]*\)$/3.\1/p' | head -1)
ABI=cp$(echo "$PYVER" | tr -d .)
mkdir -p "$DIR/wheels"
rm -f "$DIR"/wheels/fedfleet-*.whl
"$HOST_PIP" install -q 'setuptools>=77' wheel      # pyproject.toml's build backend, in the host venv
"$HOST_PIP" wheel -q --no-deps --no-build-isolation -w "$DIR/wheels" . >/dev/null
rm -rf build ./*.egg-info
WHEEL=$(ls "$DIR"/wheels/fedfleet-*.whl)
STAMP=$(sha256sum pyproject.toml | cut -c1-16)-$ABI
if [ "$(cat "$DIR/wheels/.downloaded" 2>/dev/null)" != "$STAMP" ]; then
  echo "arm64: downloading the $ABI aarch64 wheels of fedfleet[device] into $DIR/wheels"
  PIP_FIND_LINKS= "$HOST_PIP" download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
      --abi "$ABI" --abi abi3 --abi none --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 \
      --platform manylinux_2_28_aarch64 -d "$DIR/wheels" "$WHEEL[device]"
  echo "$STAMP" > "$DIR/wheels/.downloaded"
fi
$SUDO cp -u "$DIR"/wheels/*.whl "$ROOTFS/wheels/"

in_rootfs() { "$(dirname "$0")/python.sh" "$ROOTFS" "" "$@"; }
if [ "$(cat "$ROOTFS/.fedfleet-deps" 2>/dev/null)" != "$STAMP" ]; then
  echo "arm64: installing fedfleet[device] in the rootfs (pip under qemu)"
  in_rootfs -m pip install -q --no-index --find-links /wheels --break-system-packages --root-user-action=ignore --no-warn-script-location \
      --no-compile "fedfleet[device]"
  echo "$STAMP" | $SUDO tee "$ROOTFS/.fedfleet-deps" >/dev/null
fi
in_rootfs -m pip install -q --no-index --no-deps --force-reinstall --break-system-packages --root-user-action=ignore --no-warn-script-location \
    --no-compile "/wheels/$(basename "$WHEEL")"
in_rootfs -c 'import platform, sys, numpy, onnxruntime, cryptography, paho.mqtt, fedfleet.device
print(f"arm64: {platform.machine()} python {sys.version.split()[0]}, numpy {numpy.__version__}, onnxruntime {onnxruntime.__version__}")'
