#!/usr/bin/env bash
# The whole test suite, every tier: ruff, serial tests, the MPI tests under 1, 2, 3 and 4 ranks, the CPU part of
# scripts/gpu_check.sh (beside the 1-rank tier, which leaves a core idle), ranks killed mid-run under the
# fault-tolerant stack (Open MPI 5 with ULFM in .venv-ft, set up here once) and, beside them all, rendered sbatch
# templates on a real single-node SLURM (root only; installed from Debian if missing).
#
#   scripts/test.sh                         every tier (what CI runs)
#   scripts/test.sh mpi-3 slurm             only the tiers named: lint serial mpi-1 mpi-2 mpi-3 mpi-4
#                                           gpu-check-cpu ft slurm
#   scripts/test.sh quick                   the loop after an edit (~25 s on 2 idle cores): lint, the pure modules, one MPI
#                                           file per family at 2 ranks
#   scripts/test.sh serial -k resume        arguments after the tier names go to pytest
#
# Fails if any rank fails any test. Hangs are caught per test: pytest-timeout ends a test after 300 s
# (setup.cfg), and an MPI job's ranks end with it. Each tier also has a backstop limit for a hang outside a
# test, MPICOMM_TIER_TIMEOUT (3600 s), far above a tier's time on a loaded machine; when it ends a tier, a
# line says so and how to raise it. A busy machine makes tiers slower, never failed.
# As root with `unshare` available, all tiers run in a loopback-only network namespace (no MPI byte
# leaves the machine); elsewhere (a laptop, a cluster login node) they run normally.
set -uo pipefail
cd "$(dirname "$0")/.."
ALL_TIERS=(lint serial mpi-1 mpi-2 mpi-3 mpi-4 gpu-check-cpu ft slurm)
all_args=("$@")
selected=()
while [ $# -gt 0 ] && [[ " ${ALL_TIERS[*]} quick " == *" $1 "* ]]; do selected+=("$1"); shift; done
[ ${#selected[@]} -gt 0 ] || selected=("${ALL_TIERS[@]}")
wanted() { [[ " ${selected[*]} " == *" $1 "* ]]; }
[ -n "${MPICOMM_NETNS:-}" ] || scripts/setup_env.sh || exit 1   # once: not again inside the namespace
if [ -z "${MPICOMM_NETNS:-}" ] && wanted ft; then scripts/setup_env.sh --ft || exit 1; fi
if [ -z "${MPICOMM_NETNS:-}" ] && { wanted slurm || wanted serial; }; then
  scripts/install_slurm.sh   # SLURM + h5ls from Debian, as root (needs the network)
fi
if [ -z "${MPICOMM_NETNS:-}" ] && [ "$(id -u)" = 0 ] && command -v unshare >/dev/null \
   && command -v ip >/dev/null && unshare -n true 2>/dev/null; then
  exec env MPICOMM_NETNS=loopback unshare -n bash -c 'ip link set lo up && exec "$0" "$@"' "$0" "${all_args[@]}"
fi
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# MPICH's waiting ranks spin (MPIR_CVAR_ENABLE_HEAVY_YIELD unset unless the caller set it): with 4 ranks on 2
# cores the tests' many small collectives ran 4-12x slower per exchange with the yield setting
# (`python bench/transport/comm.py --compare-yield 4`) and the 4-rank tier took 284 s against 216 s.
echo "== MPICH yield when idle: ${MPIR_CVAR_ENABLE_HEAVY_YIELD:-unset}"
echo "== network: ${MPICOMM_NETNS:-host (not root or no unshare: MPI runs on the normal network stack)}"
TIER_LIMIT=${MPICOMM_TIER_TIMEOUT:-3600}
failed=()
tier() {  # tier NAME COMMAND...: run COMMAND under the backstop limit, report its exit and time
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  timeout -k 10 "$TIER_LIMIT" "$@"; local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    echo "== $name: ended by the tier limit of $TIER_LIMIT s (MPICOMM_TIER_TIMEOUT), not by a failing test; if" \
         "the machine is just slow, rerun it with: MPICOMM_TIER_TIMEOUT=$((2 * TIER_LIMIT)) scripts/test.sh $name"
  fi
  [ $rc = 0 ] || failed+=("$name (exit $rc)")
}
# A tier that leaves a core idle runs beside others: its output is kept and printed when it is joined.
beside_pids=() beside_logs=() beside_names=()
beside() {  # beside NAME COMMAND...: start the tier in the background
  local log; log=$(mktemp)
  ( failed=(); tier "$@"; [ ${#failed[@]} = 0 ] ) > "$log" 2>&1 &
  beside_pids+=($!) beside_logs+=("$log") beside_names+=("$1")
  echo "== $1: started beside the other tiers (its output follows when it ends)"
}
join_beside() {  # join_beside [NAME]: wait for the tiers started beside (or only NAME), print their output
  local i keep_pids=() keep_logs=() keep_names=()
  for i in "${!beside_pids[@]}"; do
    if [ -n "${1:-}" ] && [ "${beside_names[$i]}" != "$1" ]; then
      keep_pids+=("${beside_pids[$i]}") keep_logs+=("${beside_logs[$i]}") keep_names+=("${beside_names[$i]}")
      continue
    fi
    wait "${beside_pids[$i]}" || failed+=("${beside_names[$i]}")
    cat "${beside_logs[$i]}"; rm -f "${beside_logs[$i]}"
  done
  beside_pids=("${keep_pids[@]}") beside_logs=("${keep_logs[@]}") beside_names=("${keep_names[@]}")
}
# The SLURM tier mostly waits (the scheduler's interval, a requeued job's credential hold, a modelled 500 ms
# latency per step): it runs beside all the other tiers.
if ! wanted slurm; then
  :
elif [ "$(id -u)" = 0 ] && command -v slurmctld >/dev/null && command -v sbatch >/dev/null; then
  beside slurm scripts/slurm_local.sh python -m pytest -q -p no:cacheprovider -m slurm tests/test_slurm.py
else
  echo "== slurm: skipped (needs root and Debian's slurmctld/slurmd/munge; scripts/install_slurm.sh installs them)"
fi
if wanted lint || wanted quick; then tier lint ruff check .; fi
if wanted quick; then
  # the pure modules (no MPI job), then one MPI file per family at 2 ranks: the mutations the full suite is
  # known to catch (resume disabled, an exchange skipped, options dropped) fail here too for these families
  tier quick-serial python -m pytest -q -n 2 tests/test_topology.py tests/test_bitpack.py tests/test_codecs.py \
    tests/test_codec_kernels.py tests/test_hsq_codec.py tests/test_net_model.py tests/test_checkpoint_tree.py \
    tests/test_options.py tests/test_moniqua_serial.py "$@"
  tier quick-mpi-2 env MPICOMM_EXPECT_RANKS=2 mpiexec -n 2 python tests/mpi_run.py -q -m mpi \
    tests/test_allreduce_sgd_mpi.py tests/test_dpsgd_mpi.py tests/test_moniqua_mpi.py tests/test_pdsgdm_mpi.py \
    tests/test_compressed_sgd_mpi.py tests/test_apmsqueeze_mpi.py tests/test_powersgd_mpi.py \
    tests/test_diloco_mpi.py tests/test_user_script_mpi.py tests/test_checkpoint_mpi.py "$@"
fi
# two pytest-xdist workers: the serial tests are mostly 2-rank app jobs and their start-up, which leave one of
# two cores idle about a third of the time under one worker
# Files named tests/test_*_mpi.py hold only mpi-marked tests (which the serial tier would skip): not collected.
# Files named tests/test_*_ft.py launch their own jobs under the fault-tolerant stack: the ft tier's.
if wanted serial; then
  tier serial python -m pytest -q -n 2 --dist worksteal --ignore-glob='tests/test_*_mpi.py' \
    --ignore-glob='tests/test_*_ft.py' "$@"
fi
# 4 ranks: every MPI test. 2 ranks: all but the files whose paths do not depend on the count beyond 1 vs
# many (SAME_AT_ANY_COUNT: resume, devices, user optimizers), which run once, at 4 ranks, where a ring has two
# distinct neighbours. 1 rank: neither those nor the examples (which run once, at 2 ranks). 3 ranks, an odd
# count: the files where an odd or non-power-of-two count takes its own path -- uneven data shards, uneven
# chunks of the 1-bit/compressed allreduces, MPICH's recursive-doubling remainder in the exact payload sums,
# unequal node layouts, the collectives and the checkpoint of an odd world, uneven shards of shard=True, a user's
# script where one rank of three differs (that file skips itself at 1 and 4 ranks), and D-PSGD on the alternating
# ring, which leaves one rank out of each pairing at an odd count. The other decentralized methods see no new case
# at 3 (a ring of 3 is the complete graph; their mixing matrices are checked for every size in the serial
# topology tests). Test files named on the command line replace these lists at every count.
SAME_AT_ANY_COUNT=(tests/test_resume_mpi.py tests/test_loop_optimizer_mpi.py tests/test_device_mpi.py
                   tests/test_user_optimizer_mpi.py)
ODD_COUNT=(tests/test_rank_counts_mpi.py tests/test_comm_mpi.py tests/test_allreduce_sgd_mpi.py
           tests/test_compressed_sgd_mpi.py tests/test_apmsqueeze_mpi.py tests/test_lamb_mpi.py
           tests/test_zeroone_adam_mpi.py tests/test_hierarchy_mpi.py tests/test_checkpoint_mpi.py
           tests/test_net_mpi.py tests/test_choco_sums_mpi.py tests/test_user_script_mpi.py
           tests/test_sharding_onebit_mpi.py tests/test_dpsgd_mpi.py)
# Every rank collects only the files that hold mpi-marked tests (collecting a file imports it: seconds per
# rank), unless test files are named on the command line.
MPI_FILES=($(grep -l 'mark\.mpi' tests/test_*.py))
except() {  # except FILE...: MPI_FILES without those
  local f out=(); for f in "${MPI_FILES[@]}"; do [[ " $* " == *" $f "* ]] || out+=("$f"); done; echo "${out[@]}"
}
named=0; for arg in "$@"; do [[ $arg == tests/* ]] && named=1; done
gpu_check=(env PYTHON="$PWD/.venv/bin/python" scripts/gpu_check.sh --cpu-only
           --out "${TMPDIR:-/tmp}/mpicomm-gpu-check")   # the GPU check's CPU part, so it cannot rot
for n in 1 2 3 4; do
  wanted "mpi-$n" || continue
  only=()
  if [ "$named" = 0 ]; then
    case $n in
      1) only=($(except "${SAME_AT_ANY_COUNT[@]}" tests/test_examples_mpi.py)) ;;
      2) only=($(except "${SAME_AT_ANY_COUNT[@]}")) ;;
      3) only=("${ODD_COUNT[@]}") ;;
      4) only=("${MPI_FILES[@]}") ;;
    esac
  fi
  # one rank keeps one core busy: the GPU check's CPU part uses the other
  if [ "$n" = 1 ] && wanted gpu-check-cpu; then beside gpu-check-cpu "${gpu_check[@]}"; gpu_done=1; fi
  rank_logs=$(mktemp -d)   # ranks other than 0 write their pytest output here: shown if the tier fails
  tier "mpi-$n" env MPICOMM_EXPECT_RANKS="$n" MPICOMM_TEST_RANK_LOGS="$rank_logs" \
    mpiexec -n "$n" python tests/mpi_run.py -q -m mpi "${only[@]}" "$@"
  if [[ " ${failed[*]} " == *" mpi-$n "* ]]; then
    for log in "$rank_logs"/rank-*.log; do
      [ -s "$log" ] && { echo "== mpi-$n: the end of $(basename "$log" .log)'s pytest output:"; tail -n 40 "$log"; }
    done
  fi
  rm -rf "$rank_logs"
  [ "$n" = 1 ] && [ -n "${gpu_done:-}" ] && join_beside gpu-check-cpu
done
if wanted gpu-check-cpu && [ -z "${gpu_done:-}" ]; then tier gpu-check-cpu "${gpu_check[@]}"; fi
# a rank killed mid-run under Open MPI 5 with ULFM (scripts/ft_run.sh): each test launches its own 4-rank jobs
if wanted ft; then tier ft python -m pytest -q tests/test_rank_loss_ft.py "$@"; fi
join_beside
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED tiers: ${failed[*]}"
  exit 1
fi
echo "all tiers passed: ${selected[*]}"
