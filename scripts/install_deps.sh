#!/usr/bin/env bash
# Installs the Debian packages zerort builds and tests with, only those that are missing.
set -euo pipefail
packages=(cmake g++ make openmpi-bin libopenmpi-dev libgtest-dev ccache iproute2 util-linux clang-format liburing-dev fio)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "deps: all Debian packages present (${packages[*]})"
  exit 0
fi
echo "deps: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
