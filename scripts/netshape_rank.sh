#!/usr/bin/env bash
# Per-rank wrapper of scripts/netshape.sh: mpiexec runs it once per rank (exported there as
# MPICOMM_NETSHAPE_WRAP); it runs the rank's program inside that rank's network namespace,
# ${MPICOMM_NETSHAPE_PREFIX}${PMI_RANK} (e.g. mcns-1234-r0), where the only link is the shaped mc0.
#   mpiexec -n N "$MPICOMM_NETSHAPE_WRAP" python app.py
# Hydra (MPICH's mpiexec) sets PMI_RANK; the PMI connection is an inherited fd, so it crosses namespaces.
set -euo pipefail
fail() { echo "netshape_rank.sh: $*" >&2; exit 2; }
[ $# -gt 0 ] || fail "usage: mpiexec -n N \"\$MPICOMM_NETSHAPE_WRAP\" PROGRAM ARGS..."
[ -n "${PMI_RANK:-}" ] || fail "PMI_RANK is unset: run me under MPICH's mpiexec (hydra), as set up by scripts/netshape.sh"
[ -n "${MPICOMM_NETSHAPE_PREFIX:-}" ] || fail "MPICOMM_NETSHAPE_PREFIX is unset: run me under scripts/netshape.sh"
if [ -n "${MPICOMM_NETSHAPE_RANKS:-}" ] && [ "$PMI_RANK" -ge "$MPICOMM_NETSHAPE_RANKS" ]; then
  fail "rank $PMI_RANK but the network was built for $MPICOMM_NETSHAPE_RANKS ranks (--ranks)"
fi
exec ip netns exec "${MPICOMM_NETSHAPE_PREFIX}${PMI_RANK}" "$@"
