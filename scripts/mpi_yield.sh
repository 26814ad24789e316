# Sourced by scripts/demo.sh: with more MPI ranks than cores, export MPICH's MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (a
# waiting rank sleeps instead of spinning) and Open MPI's equivalent, OMPI_MCA_mpi_yield_when_idle=1 (each
# library ignores the other's). Measured on 2 cores: training steps are within noise either way (one run each of
# `mpiexec -n 8 python apps/train_resnet.py --algorithm moniqua --max-steps 30 --batch-size 32`: 41 s with it,
# 44 s without), while small exchanges are 4-12x slower with it
# (`python bench/transport/comm.py --compare-yield 4`), so the test tiers, which are mostly small exchanges,
# leave it unset. A value already in the environment wins; the sbatch templates do the same from SLURM's counts.
mpi_yield_if_oversubscribed() {  # RANKS: export the yield settings when RANKS > the cores this process may use
  if [ "$1" -gt "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" ]; then  # nproc obeys OMP_* otherwise
    export MPIR_CVAR_ENABLE_HEAVY_YIELD="${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}"
    export OMPI_MCA_mpi_yield_when_idle="${OMPI_MCA_mpi_yield_when_idle:-1}"
  fi
}
