#!/bin/bash
# `make images`: the images built with buildah from a local Debian base, with no registry pull
# (docs/operations.md, "Images"), then the CPU image's smoke test. Needs root, buildah and
# debootstrap (Debian: apt-get install buildah debootstrap) and a Debian mirror; pip reaches
# PyPI, and the wheels in WHEELS (a torch CPU wheel, where PyPI's torch is the CUDA one) are
# served to it over 127.0.0.1 (buildah's chroot shares the host's network).
#
#   IMAGES="cpu cuda ascend"  which images (cpu: built and smoke-tested; cuda, ascend: their
#                             steps on the Debian base in place of nvidia/cuda and CANN,
#                             which cannot be pulled here)
#   WHEELS=/opt/wheels        extra wheels for pip (find-links), served over HTTP
#   MIRROR=http://deb.debian.org/debian
#   CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt   the certificates pip in the base trusts
#   LOG=build/images.log      every step's output; its size and each step's time at the end
set -euo pipefail

IMAGES=${IMAGES:-cpu cuda ascend}
WHEELS=${WHEELS:-/opt/wheels}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
LOG=${LOG:-build/images.log}
BASE=localhost/chunkstore-base:bookworm
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
mkdir -p "$(dirname "$LOG")"
: >"$LOG"

step() {  # step NAME COMMAND...: run it, its output to the log, its time on the terminal
  local name=$1 began=$SECONDS
  shift
  echo "== $name: $*" >>"$LOG"
  if "$@" >>"$LOG" 2>&1; then
    echo "images: $name ok ($((SECONDS - began)) s)"
  else
    echo "images: $name FAILED after $((SECONDS - began)) s; the log: $LOG" >&2
    tail -20 "$LOG" >&2
    exit 1
  fi
}

base_image() {  # Debian bookworm (minbase) with python3 and a venv on PATH: the python:3.11 role
  local rootfs ctr
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$MIRROR"
  ctr=$(buildah from scratch)
  buildah copy "$ctr" "$rootfs" /
  rm -rf "$rootfs"
  buildah run "$ctr" -- python3 -m venv /opt/python
  # pip in the image trusts what this host trusts (a TLS-inspecting proxy's CA, here).
  buildah copy "$ctr" "$CA_BUNDLE" /etc/ssl/certs/ca-certificates.crt
  buildah config --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah commit --rm "$ctr" "$BASE"
}

build() {  # build NAME DOCKERFILE BUILD-ARG...
  local name=$1 file=$2
  shift 2
  buildah bud --pull-never --layers=false -f "$file" -t "localhost/chunkstore:$name" \
    --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$PORT/" --build-arg PIP_TRUSTED_HOST=127.0.0.1 \
    --build-arg "PIP_CONSTRAINT=http://127.0.0.1:$PORT/constraints.txt" "$@" .
}

smoke() {  # the CPU image's entrypoint: its version, and a daemon answering health inside
  local ctr status=0
  ctr=$(buildah from localhost/chunkstore:cpu)
  buildah run "$ctr" -- chunkstore --version || status=1  # (set -e is off inside `if`)
  [ $status = 0 ] && buildah run "$ctr" -- sh -c '
    chunkstore serve --socket /run/chunkstore/chunkstore.sock --tcp 127.0.0.1:50661 --metrics "" \
      --pool-bytes 67108864 & daemon=$!
    for _ in $(seq 60); do
      if chunkstore health --address 127.0.0.1:50661 2>/dev/null; then
        kill -TERM $daemon && wait $daemon; exit
      fi
      sleep 1
    done
    kill $daemon; exit 1' || status=1
  buildah rm "$ctr" >/dev/null
  return $status
}

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  step "base image (debootstrap, ~2 min)" base_image
fi
# What pip gets besides PyPI: WHEELS' wheels, each pinned (constraints.txt), over HTTP.
served=$(mktemp -d)
for wheel in "$WHEELS"/*.whl; do
  [ -e "$wheel" ] || continue
  ln -s "$wheel" "$served/"
  name_version=$(basename "$wheel" | cut -d- -f1,2)
  echo "${name_version%%-*}==${name_version#*-}" >>"$served/constraints.txt"
done
touch "$served/constraints.txt"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server --bind 127.0.0.1 --directory "$served" "$PORT" >>"$LOG" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$served"' EXIT
for image in $IMAGES; do
  case $image in
    cpu)
      step "cpu image" build cpu docker/Dockerfile.cpu --build-arg "PYTHON_IMAGE=$BASE"
      step "cpu smoke test (version, serve + health inside)" smoke
      ;;
    cuda) step "cuda image's steps on the Debian base" build cuda-steps docker/Dockerfile.cuda \
      --build-arg "CUDA_IMAGE=$BASE" ;;
    ascend) step "ascend image's steps on the Debian base" build ascend-steps \
      docker/Dockerfile.ascend --build-arg "CANN_IMAGE=$BASE" ;;
    *) echo "images: unknown image $image (cpu, cuda, ascend)" >&2; exit 2 ;;
  esac
done
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep chunkstore | tee -a "$LOG"
echo "images: log $LOG, $(wc -c <"$LOG") bytes"
