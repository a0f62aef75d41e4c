#!/bin/sh
# Runs the packed GPU-host bench from an unpacked copy of the kit, here (CPU Vulkan driver, e.g. lavapipe), to check
# the bundle before spending device time:  sh tools/gpu-kit/check-local.sh [bench flags]   (default: --quick)
# LLAMA=vulkan (default) runs llama.cpp's Vulkan build from the kit on the CPU driver; LLAMA=cpu adds the CPU build
# from node_modules to the copy. run.sh is not used: it unpacks the kit's Vulkan loader debs into / (host only).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LLAMA=${LLAMA:-vulkan}
for f in kit.tar.xz bench.mjs llama-kit.tar.xz; do
  [ -f "$ROOT/.gpu/$f" ] || { echo "check-local: .gpu/$f is missing; run npm run bench:bundle" >&2; exit 1; }
done
T=$(mktemp -d /tmp/longtab-kit-check.XXXXXX)
trap 'rm -rf "$T"' EXIT
tar xJf "$ROOT/.gpu/kit.tar.xz" -C "$T"
tar xJf "$ROOT/.gpu/llama-kit.tar.xz" -C "$T/kit"
cp "$ROOT/.gpu/bench.mjs" "$T/kit/bench.mjs"
if [ "$LLAMA" = cpu ]; then cp -r "$ROOT/node_modules/@node-llama-cpp/linux-x64" "$T/kit/node_modules/@node-llama-cpp/"; fi
# One llama.cpp thread: the Vulkan build finds no GPU on a CPU driver and runs on 2 shared cores here.
[ $# -ge 1 ] || set -- --quick --llama-threads 1
mkdir -p "$ROOT/.gpu/check-out"
cd "$T"
XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp} "$T/kit/bin/node" "$T/kit/bench.mjs" --llama "$LLAMA" \
  --models-dir "$T/models" --out "$ROOT/.gpu/check-out" "$@"
