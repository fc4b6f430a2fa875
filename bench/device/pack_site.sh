#!/usr/bin/env bash
# Packs the device's Python packages into .site.tar.xz: every wheel in .whl/ unpacked into one tree (what
# `pip install --no-deps --target` makes of pure and binary wheels alike, less the console scripts) and
# xz-compressed. A call carries 64 MiB with the working tree; the wheels with aiortc's and cryptography take
# 55 MB (deflate, per file), the packed tree 36 MB. common.sh's install_wheels unpacks it when carried:
#
#     bash bench/device/pack_site.sh          # then carry [".site.tar.xz"] instead of [".whl"]
#     bash bench/device/pack_site.sh --lean   # the same without WebRTC and PyAV (~5 MB): for training and
#                                             # train.fade calls, which carry a candidate's weights beside it
set -eu -o pipefail
lean='^(aioice|aiortc|av|cffi|cryptography|dnspython|google_crc32c|ifaddr|pycparser|pyee|pylibsrtp|pyopenssl)-'
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for wheel in .whl/*.whl; do
  if [ "${1:-}" = --lean ] && [[ $(basename "$wheel") =~ $lean ]]; then continue; fi
  unzip -q -o "$wheel" -d "$work/site"
done
tar -cJf .site.tar.xz -C "$work/site" .
ls -la .site.tar.xz
