#!/usr/bin/env bash
# The GPU check in one command: codecs on CUDA vs CPU, device collectives at 2 and 4 ranks (staged, and
# direct when MPI is CUDA-aware), ResNet-20 with every algorithm on cuda vs cpu, codec throughput against
# a device-to-device copy at 16M/64M elements, ResNet-20 step times, host syncs per step (bench/per_step/host_syncs.py),
# bf16 and fp16 runs. Ranks share the
# node's GPUs (cuda:{local rank % GPUs}). Writes OUT/gpu_check.json and prints a short table; exit 1 if a
# check failed. Budget: about 5 minutes on one H200 (each part has its own timeout).
#
#   scripts/gpu_check.sh [--cpu-only] [--out DIR]      (default DIR: gpu_check)
#
# Python: $PYTHON if set; else .venv when its torch sees CUDA; else a .venv-gpu made with
# --system-site-packages over the system's CUDA torch (pip installs mpicomm[mpi,apps] into it).
# --cpu-only runs every part that needs no GPU, on the CPU through the code paths CUDA tensors take
# (the codecs' torch path, staging through host buffers); scripts/test.sh runs it so it cannot rot.
set -uo pipefail
cd "$(dirname "$0")/.."
CPU_ONLY=0
OUT=gpu_check
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-only) CPU_ONLY=1 ;;
    --out) OUT=$2; shift ;;
    *) echo "usage: scripts/gpu_check.sh [--cpu-only] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
sees_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif [ "$CPU_ONLY" = 1 ]; then
  scripts/setup_env.sh || exit 1
  py=.venv/bin/python
elif [ -x .venv/bin/python ] && sees_cuda .venv/bin/python; then
  py=.venv/bin/python
elif sees_cuda python3; then
  if [ ! -x .venv-gpu/bin/python ]; then
    python3 -m venv --system-site-packages .venv-gpu && .venv-gpu/bin/python -m pip install -q -e ".[mpi,apps]" \
      || { echo "gpu_check: could not set up .venv-gpu"; exit 1; }
  fi
  py=.venv-gpu/bin/python
else
  echo "gpu_check: no Python with a CUDA-enabled torch (set PYTHON=..., or use --cpu-only)" >&2
  exit 2
fi
bin=$(dirname "$py")
# the CPU side of the cuda-vs-cpu runs: a few threads per rank on a GPU node, one in CI
if [ "$CPU_ONLY" = 1 ]; then threads=1; else threads=4; fi
export PATH="$bin:$PATH" OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
case "$OUT" in ""|.|/|..) echo "gpu_check: --out needs a folder of its own" >&2; exit 2 ;; esac
rm -rf "$OUT" && mkdir -p "$OUT"
flags=(--out "$OUT")
train=(--steps 20 --batch 32)
if [ "$CPU_ONLY" = 1 ]; then flags+=(--cpu-only); train=(--steps 2 --batch 8); fi
mpi=(mpiexec)
[ "$(id -u)" = 0 ] && "$bin/mpiexec" --version 2>/dev/null | grep -qi "open mpi" && mpi+=(--allow-run-as-root --oversubscribe)
failed=()
part() {  # part SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s (log: $OUT/$name.log)"
  [ $rc = 0 ] || { failed+=("$name"); tail -5 "$OUT/$name.log"; }
}
part 60 codecs "$py" bench/gpu/gpu_check.py codecs "${flags[@]}"
part 60 comm-2 "${mpi[@]}" -n 2 "$py" bench/gpu/gpu_check.py comm "${flags[@]}"
part 60 comm-4 "${mpi[@]}" -n 4 "$py" bench/gpu/gpu_check.py comm "${flags[@]}"
part 200 train "${mpi[@]}" -n 2 "$py" bench/gpu/gpu_check.py train "${flags[@]}" "${train[@]}"
if [ "$CPU_ONLY" = 0 ]; then
  part 60 throughput "$py" bench/gpu/gpu_check.py throughput "${flags[@]}"
  part 60 steptime "${mpi[@]}" -n 2 "$py" bench/gpu/gpu_check.py steptime "${flags[@]}"
  part 60 host-syncs "${mpi[@]}" -n 4 "$py" bench/per_step/host_syncs.py --device cuda --out "$OUT/host_syncs.json"
fi
part 90 precision "${mpi[@]}" -n 2 "$py" bench/gpu/gpu_check.py precision "${flags[@]}" "${train[@]}"
"$py" bench/gpu/gpu_check.py report "${flags[@]}"; rc=$?
[ ${#failed[@]} -eq 0 ] || { echo "gpu_check: parts that did not finish: ${failed[*]}"; exit 1; }
exit $rc
