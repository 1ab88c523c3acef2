#!/bin/bash
# Runs rows_probe.py with onnxruntime's aarch64 wheel under qemu-user, for a few ARM cores (Debian 12, root).
# Emulation executes the same kernels a real core with those features would (onnxruntime picks them from the
# CPU's features), with IEEE float semantics; it says nothing about speed. Usage: rows_under_qemu.sh [DIR]
set -euo pipefail
DIR=${1:-/tmp/arm}
shift || true
HERE=$(cd "$(dirname "$0")" && pwd)
ORT=${ORT_VERSION:-1.32.0}
mkdir -p "$DIR/debs" "$DIR/root/proc" "$DIR/site" "$DIR/wheels"
command -v qemu-aarch64-static > /dev/null || apt-get install -y -q qemu-user-static
dpkg --print-foreign-architectures | grep -q arm64 || { dpkg --add-architecture arm64; apt-get update -q; }
(cd "$DIR/debs" && apt-get download python3.11-minimal:arm64 libpython3.11-minimal:arm64 \
    libpython3.11-stdlib:arm64 libc6:arm64 libstdc++6:arm64 libgcc-s1:arm64 zlib1g:arm64 libexpat1:arm64 \
    libffi8:arm64 libssl3:arm64 libbz2-1.0:arm64 liblzma5:arm64 libuuid1:arm64 libcrypt1:arm64 libgomp1:arm64)
for deb in "$DIR"/debs/*.deb; do dpkg -x "$deb" "$DIR/root"; done
pip download -q --only-binary=:all: --no-deps --python-version 3.11 --platform manylinux_2_28_aarch64 \
    -d "$DIR/wheels" "onnxruntime==$ORT" numpy
if [ $# -gt 0 ]; then  # specedge itself (check imports onnx), laid out as its installed package
    ONNX=${ONNX_VERSION:-$(python3 -c "import onnx; print(onnx.__version__)" 2> /dev/null || true)}
    pip download -q --only-binary=:all: --no-deps --python-version 3.11 --platform manylinux_2_28_aarch64 \
        --platform manylinux2014_aarch64 --platform any -d "$DIR/wheels" "onnx${ONNX:+==$ONNX}" protobuf ml_dtypes \
        typing_extensions
    REPO=$(cd "$HERE/../.." && pwd)
    rm -rf "$DIR/pkg" && mkdir -p "$DIR/pkg/specedge"
    ln -s "$REPO"/specedge/*.py "$DIR/pkg/specedge/"
    for part in export graphs runtime tools serve; do ln -s "$REPO/$part" "$DIR/pkg/specedge/$part"; done
fi
for wheel in "$DIR"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$DIR/site"; done

# qemu-user shows the host's /proc/cpuinfo; onnxruntime reads the core's features there, so each core gets its
# own file under the emulated root (qemu looks there first): Cortex-A76 and Neoverse-N1 have the int8 dot
# product (asimddp), Cortex-A72 (Raspberry Pi 4; the A57 of older Jetsons is the same ISA) has not.
cpuinfo() {  # $1: features, $2: part number
    for cpu in 0 1; do
        printf 'processor\t: %s\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\n' "$cpu" "$1"
        printf 'CPU variant\t: 0x0\nCPU part\t: %s\nCPU revision\t: 1\n\n' "$2"
    done > "$DIR/root/proc/cpuinfo"
}
BASE="fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"
DOT="$BASE atomics fphp asimdhp asimdrdm lrcpc dcpop asimddp"
for core in "cortex-a76:$DOT:0xd0b" "neoverse-n1:$DOT:0xd0c" "cortex-a72:$BASE:0xd08"; do
    IFS=: read -r model features part <<< "$core"
    cpuinfo "$features" "$part"
    echo "== $model"
    run=(env QEMU_CPU="$model" PYTHONHOME=/usr PYTHONPATH="$DIR/pkg:$DIR/site"
         qemu-aarch64-static -L "$DIR/root" "$DIR/root/usr/bin/python3.11")
    "${run[@]}" "$HERE/rows_probe.py"
    if [ $# -gt 0 ]; then "${run[@]}" "$HERE/model_check.py" "$@"; fi
done
