#!/usr/bin/env bash
# Install Debian's SLURM, munge and the HDF5 command-line tools if missing (root + apt-get only).
# Prints why and exits 0 without installing when that is impossible; the SLURM tests then skip.
set -uo pipefail
need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || [ -x /usr/sbin/munged ] || need+=(munge)
command -v h5ls >/dev/null || need+=(hdf5-tools)
[ ${#need[@]} = 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_slurm: not root or no apt-get; not installing ${need[*]} (SLURM tests will skip)"; exit 0
fi
echo "install_slurm: installing ${need[*]}"
apt-get update -qq >/dev/null 2>&1
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/tmp/mpicomm-apt.log 2>&1 \
  || { tail -5 /tmp/mpicomm-apt.log; echo "install_slurm: apt-get failed (SLURM tests will skip)"; }
exit 0
