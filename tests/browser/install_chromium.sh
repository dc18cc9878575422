#!/bin/sh
# Installs headless Chromium for the browser test (tests/browser): Debian's `chromium` package.
# Idempotent: when a Chromium is already there ($ANCHOR_CHROMIUM, or chromium / chromium-browser /
# google-chrome on PATH) it prints its path and exits at once. Root installs with apt-get; other
# users through `sudo -n` when that works without a password; otherwise one line says what to run
# and the script exits 2.
set -eu

found() {
    if [ -n "${ANCHOR_CHROMIUM:-}" ]; then
        [ -x "$ANCHOR_CHROMIUM" ] && echo "$ANCHOR_CHROMIUM" && return 0
        echo "install_chromium.sh: ANCHOR_CHROMIUM=$ANCHOR_CHROMIUM is not an executable file" >&2
        exit 2
    fi
    for name in chromium chromium-browser google-chrome google-chrome-stable; do
        if command -v "$name" >/dev/null 2>&1; then
            command -v "$name"
            return 0
        fi
    done
    return 1
}

found && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium.sh: no Chromium and no apt-get: install Chromium with your package manager, or set ANCHOR_CHROMIUM=/path/to/chromium" >&2
    exit 2
fi
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install_chromium.sh: no Chromium: run 'sudo apt-get install -y chromium' (or set ANCHOR_CHROMIUM=/path/to/chromium)" >&2
    exit 2
fi

echo "install_chromium.sh: installing Debian's chromium package" >&2
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or stale on a fresh machine: refresh them only when needed.
$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
    || { echo "install_chromium.sh: 'apt-get install chromium' failed (on Ubuntu Chromium is a snap: install it, or set ANCHOR_CHROMIUM)" >&2; exit 2; }
found || { echo "install_chromium.sh: chromium was installed but is not on PATH" >&2; exit 2; }
