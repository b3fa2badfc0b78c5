#!/bin/sh
# `make image-test`: run the image built by `make image` and check it from the host. podman cannot start
# containers on these machines (crun: setrlimit RLIMIT_NPROC: operation not permitted), so the image runs under
# `buildah run` (chroot isolation, host network) with its own entrypoint, command and user. Once the router is
# healthy, the image's own HEALTHCHECK command runs inside it, then scripts/image/check.py from the host; then
# SIGTERM to the launcher, as `docker stop` sends, and a check that nothing is left running.
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
IMAGE=${IMAGE:-localhost/disagg-cpu:latest}
LOG="$ROOT/build/image/test-run.log"
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
for port in 8000 8001 8002 8080; do
  if "$ROOT/.venv/bin/python" -c "import sys; from serving.ports import port_free; sys.exit(port_free('127.0.0.1', $port))"; then
    echo "[image-test] port $port is in use on this host" >&2; exit 1
  fi
done
CTR=$(buildah from "$IMAGE")
RUN=$(buildah inspect --format '{{range .OCIv1.Config.Entrypoint}}{{.}} {{end}}{{range .OCIv1.Config.Cmd}}{{.}} {{end}}' "$CTR")
HEALTH=$(buildah inspect --format '{{range .Docker.Config.Healthcheck.Test}}{{.}}{{"\n"}}{{end}}' "$CTR" | sed -n 2p)
launcher() { pgrep -f "python[0-9.]* /opt/disagg/.venv/bin/disagg launch" || true; }  # not `buildah run` itself
cleanup() {
  for pid in $(launcher); do kill -TERM "$pid" 2> /dev/null || true; done
  i=0; while [ -n "$(launcher)" ] && [ "$i" -lt 60 ]; do sleep 1; i=$((i + 1)); done
  buildah rm "$CTR" > /dev/null 2>&1 || true
}
trap cleanup EXIT
echo "[image-test] $IMAGE: $RUN (as $(buildah inspect --format '{{.OCIv1.Config.User}}' "$CTR"))"
# shellcheck disable=SC2086
buildah run --network host "$CTR" -- $RUN > "$LOG" 2>&1 &
i=0
until curl -sf http://127.0.0.1:8080/health > /dev/null 2>&1; do
  i=$((i + 1))
  if [ "$i" -gt 300 ] || [ -z "$(launcher)" ] && [ "$i" -gt 10 ]; then
    echo "[image-test] not healthy; the log:" >&2; tail -40 "$LOG" >&2; exit 1
  fi
  sleep 2
done
echo "[image-test] healthy after ~$((i * 2)) s"
buildah run --network host "$CTR" -- sh -c "$HEALTH" && echo "[image-test] the image's HEALTHCHECK passes"
"$ROOT/.venv/bin/python" "$ROOT/scripts/image/check.py"
cleanup
trap - EXIT
left() {
  ps -eo stat=,args= | awk '$1 !~ /^Z/' | grep -E "tritonserver|configs/image.yaml|frontend .*router.yaml" | grep -v grep || true
  ls /dev/shm | grep "^disagg_" || true  # the Python backend's shared memory (the launcher removes what is left)
}
i=0; while [ -n "$(left)" ] && [ "$i" -lt 10 ]; do sleep 1; i=$((i + 1)); done  # exited processes not yet reaped
if [ -n "$(left)" ]; then
  echo "[image-test] something is left running:" >&2; left >&2; exit 1
fi
echo "[image-test] stopped on SIGTERM; nothing left running, no shared memory left"
