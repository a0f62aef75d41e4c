#!/usr/bin/env bash
# System packages longtab's development and tests need on Debian 12 (bookworm), installed only when missing:
#   chromium, chromium-driver  browser tests (Playwright drives /usr/bin/chromium; WebGPU runs on its SwiftShader)
#   libvulkan1                 the Vulkan loader Dawn (npm 'webgpu') uses for GPU tests in Node
#   mesa-vulkan-drivers        lavapipe, a CPU Vulkan driver, from bookworm-backports: Dawn rejects Debian 12's own
#                              Mesa 22 lavapipe, and Mesa 25 is ~3x faster than SwiftShader with f16 support
# Run it as root or as a user with sudo (bash tools/setup.sh). The README's two commands and .ci/run all install through this file.
set -euo pipefail

BACKPORTS_SUITE=bookworm-backports
PACKAGES=(chromium chromium-driver libvulkan1)
BACKPORTS_PACKAGES=(mesa-vulkan-drivers)
MIN_MESA_VERSION=25

log() { printf '[setup] %s\n' "$*"; }

# As root it installs directly (a bare Debian has no sudo); as a user it asks sudo for root.
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo bash "$0" "$@"; fi
  echo "tools/setup.sh installs Debian packages: run it as root (su -c 'bash tools/setup.sh'), or install sudo." >&2
  exit 1
fi
if ! grep -qs '^VERSION_CODENAME=bookworm$' /etc/os-release; then
  echo "tools/setup.sh supports Debian 12 (bookworm) only. Elsewhere install by hand: Chromium at /usr/bin/chromium" >&2
  echo "(or set LONGTAB_CHROMIUM to your Chromium), the Vulkan loader, and a Vulkan driver Dawn accepts (Mesa >= 24 lavapipe or a GPU driver)." >&2
  exit 1
fi

# Node comes from nodejs.org or NodeSource, not from Debian 12 (which has Node 18): only check it.
check_node() {
  local version
  if ! version=$(node --version 2>/dev/null); then
    log "WARNING: node is not on this PATH; longtab needs Node.js 20 or newer for npm ci / npm test"
    return
  fi
  local major=${version#v}
  major=${major%%.*}
  if ((major < 20)); then log "WARNING: node $version is too old; longtab needs Node.js 20 or newer"; fi
}
check_node

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

missing=()
for pkg in "${PACKAGES[@]}"; do installed "$pkg" || missing+=("$pkg"); done
missing_backports=()
for pkg in "${BACKPORTS_PACKAGES[@]}"; do
  if ! installed "$pkg"; then
    missing_backports+=("$pkg")
  elif ! dpkg --compare-versions "$(dpkg-query -W -f='${Version}' "$pkg")" ge "$MIN_MESA_VERSION"; then
    # Debian 12's own Mesa (22.3) is installed: Dawn rejects its lavapipe, so upgrade it from backports.
    missing_backports+=("$pkg")
  fi
done

if [[ ${#missing[@]} -eq 0 && ${#missing_backports[@]} -eq 0 ]]; then
  log "all system packages present: ${PACKAGES[*]} ${BACKPORTS_PACKAGES[*]} (>= $MIN_MESA_VERSION)"
  exit 0
fi

if [[ ${#missing_backports[@]} -gt 0 ]] &&
  ! grep -rqsE "^[^#]*\b${BACKPORTS_SUITE}\b" /etc/apt/sources.list /etc/apt/sources.list.d/; then
  log "adding $BACKPORTS_SUITE to /etc/apt/sources.list.d/$BACKPORTS_SUITE.list"
  echo "deb http://deb.debian.org/debian $BACKPORTS_SUITE main" >"/etc/apt/sources.list.d/$BACKPORTS_SUITE.list"
fi

export DEBIAN_FRONTEND=noninteractive
log "apt-get update"
apt-get update -q
if [[ ${#missing[@]} -gt 0 ]]; then
  log "installing ${missing[*]}"
  apt-get install -y -q "${missing[@]}"
fi
if [[ ${#missing_backports[@]} -gt 0 ]]; then
  log "installing ${missing_backports[*]} from $BACKPORTS_SUITE"
  apt-get install -y -q -t "$BACKPORTS_SUITE" "${missing_backports[@]}"
fi
log "done"
