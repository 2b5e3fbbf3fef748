#!/bin/sh
# shmkv's node preparation: on managed clusters (GKE, EKS, AKS), without
# systemd, as the DaemonSet's privileged init container runs it (kubernetes/shmkv-daemonset.yaml) with the host's /run
# and /var/lib mounted at $HOST_ROOT/run and $HOST_ROOT/var/lib (propagation
# Bidirectional, so the tmpfs it mounts is the host's). Idempotent: a second
# run changes nothing; a directory in the way that is not what shmkv needs
# (another owner, a mode others can enter, not a tmpfs) is fixed or refused
# with one line naming it. On a self-managed host, shmkv-prepare-node.service
# runs it at boot with HOST_ROOT=/.
#   SHMKV_UID (1000), SHMKV_SEGMENTS_SIZE (40g), HOST_ROOT (/host)
set -eu
uid="${SHMKV_UID:-1000}"
size="${SHMKV_SEGMENTS_SIZE:-40g}"
root="${HOST_ROOT:-/host}"
root="${root%/}"  # HOST_ROOT=/ (a host preparing itself): /run/shmkv, not //run/shmkv
seg="$root/run/shmkv"
state="$root/var/lib/shmkv"

mkdir -p "$seg" "$state"
if ! mountpoint -q "$seg"; then
  # huge=within_size: the segment on huge pages (docs/install.md "GPU hosts"); a kernel without it: 4 KiB pages
  mount -t tmpfs -o "size=$size,mode=0700,uid=$uid,gid=$uid,huge=within_size,nosuid,nodev,noexec" shmkv "$seg" 2>/dev/null \
    || mount -t tmpfs -o "size=$size,mode=0700,uid=$uid,gid=$uid,nosuid,nodev,noexec" shmkv "$seg"
  echo "prepare-node: mounted a tmpfs of $size at $seg for uid $uid"
fi
fstype="$(stat -f -c %T "$seg")"
if [ "$fstype" != "tmpfs" ]; then
  echo "prepare-node: $seg is mounted but is $fstype, not a tmpfs: unmount it or mount a tmpfs there" >&2
  exit 1
fi
for d in "$seg" "$state"; do
  if [ "$(stat -c %u:%a "$d")" != "$uid:700" ]; then
    chown "$uid:$uid" "$d"
    chmod 0700 "$d"
    echo "prepare-node: $d is now uid $uid, mode 0700"
  fi
done
echo "prepare-node: ready ($seg: tmpfs $(stat -c %u:%a "$seg"); $state: $(stat -c %u:%a "$state"))"
