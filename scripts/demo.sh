#!/usr/bin/env bash
# The main job on the embedded default: set up (once), then run on 4 MPI ranks.
# As root with `unshare`, MPI runs in a loopback-only network namespace (nothing leaves the machine).
# Extra arguments go to the job, e.g. scripts/demo.sh --numel 1000000
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RANKS=${RANKS:-4}
cmd=(mpiexec -n "$RANKS" mpicomm demo "$@")
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null && unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up && exec "$@"' _ "${cmd[@]}"
fi
exec "${cmd[@]}"
