#!/usr/bin/env bash
# Start the shmkv daemon (maintainer + controller API) for this host's cache.
#
#   scripts/start_shm_daemon.sh [--config FILE] [--cache NAME] [--capacity 8GiB]
#                               [--disk-dir DIR] [--listen 127.0.0.1:7470|unix:/path]
#                               [--background [--log-file FILE]]
#
# Foreground by default (Ctrl-C or SIGTERM stops it; the segment and its chunks
# stay for the vLLM processes attached). --background returns once it serves and
# prints its pid. Settings may also come from SHMKV_* variables (docs/configuration.md;
# `shmkv config` shows what is in force). PYTHON picks the interpreter (default python3).
set -euo pipefail
exec "${PYTHON:-python3}" -m shmkv.daemon "$@"
