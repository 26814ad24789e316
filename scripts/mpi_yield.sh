# Sourced by the launch scripts (demo.sh, test.sh): with more MPI ranks than cores, MPICH's waiting ranks
# busy-poll the cores their peers need; `python bench/transport/comm.py --compare-yield 4` measured small neighbour
# exchanges 15-27x faster on 2 cores with MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (a waiting rank sleeps instead).
# Open MPI's equivalent, OMPI_MCA_mpi_yield_when_idle=1, is set too (each library ignores the other's).
# A value already in the environment wins; slurm/generic.sbatch does the same from SLURM's counts.
mpi_yield_if_oversubscribed() {  # RANKS: export the yield settings when RANKS > the cores this process may use
  if [ "$1" -gt "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" ]; then  # nproc obeys OMP_* otherwise
    export MPIR_CVAR_ENABLE_HEAVY_YIELD="${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}"
    export OMPI_MCA_mpi_yield_when_idle="${OMPI_MCA_mpi_yield_when_idle:-1}"
  fi
}
