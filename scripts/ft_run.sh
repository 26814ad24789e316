#!/usr/bin/env bash
# Launch a job under the fault-tolerant stack: Open MPI 5 with User-Level Failure Mitigation (ULFM), from
# .venv-ft (set up here on first use by scripts/setup_env.sh --ft). Arguments are mpirun's; `python` in the
# command is the stack's own:
#
#   scripts/ft_run.sh -n 4 python apps/train_resnet.py --algorithm dpsgd --on-rank-loss continue
#
# More ranks than cores are allowed (oversubscription), and so is running as root (containers). Open MPI's own
# launcher runs the ranks: inside a SLURM allocation too (its srun integration is not fault tolerant).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-ft/bin/mpirun ] || scripts/setup_env.sh --ft >&2
export PATH="$PWD/.venv-ft/bin:$PATH"
export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Open MPI's treematch topology module is untested after a failure (it warns at every start): the basic one
export OMPI_MCA_topo=${OMPI_MCA_topo:-basic}
# Replacement ranks (--on-rank-loss replace) are reached over TCP (Open MPI does not give a spawned process
# shared memory with the others): name the transports, and where loopback is the only interface (a test's
# network namespace) let TCP use it
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,sm,tcp}
if [ -z "${OMPI_MCA_btl_tcp_if_include:-}" ] && ! ip -o link show up 2>/dev/null | grep -qv ' lo:'; then
  export OMPI_MCA_btl_tcp_if_include=lo
fi
exec mpirun --with-ft ulfm "$@"
