#!/usr/bin/env bash
# The main job on the embedded default: set up (once), then train ResNet-20 with 1-bit Moniqua on 4 MPI
# ranks on the embedded digits data; prints the final test accuracy of the averaged model and bytes sent.
# As root with `unshare`, MPI runs in a loopback-only network namespace (nothing leaves the machine).
# Extra arguments go to the app, e.g. scripts/demo.sh --epochs 10 --algorithm dpsgd
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RANKS=${RANKS:-4}
algorithm=(--algorithm moniqua --bits 1)   # another --algorithm in the arguments replaces both
for arg in "$@"; do case "$arg" in --algorithm|--algorithm=*) algorithm=() ;; esac; done
cmd=(mpiexec -n "$RANKS" python apps/train_resnet.py --model resnet20 "${algorithm[@]}"
     --epochs 4 --lr 0.1 --momentum 0.9 --out-dir runs/demo "$@")
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null && unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up && exec "$@"' _ "${cmd[@]}"
fi
exec "${cmd[@]}"
