#!/usr/bin/env bash
# Reproduce every table and plot of the README's Results section, in order (about an hour on 2 cores).
#   bench/reproduce.sh                 # everything
#   bench/reproduce.sh tta bert        # only some: comm codecs decentralized centralized moniqua
#                                      #            netvalidate tta bert hsq scaling moniqua-theta
#                                      #            peers peers-apps step-overhead
# As root with `unshare`, everything runs in a loopback-only network namespace (the shaped-network
# validation builds its own namespaces inside it); elsewhere it runs on the normal network stack.
# Wall-clock cases are cached in bench/results/runs/ (ignored by git); add --fresh to a bench script to
# rerun them. Outputs: bench/results/*.json (transport/codec/convergence) and docs/results/ (wall clock).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
if [ -z "${MPICOMM_NETNS:-}" ] && [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare -n true 2>/dev/null; then
  exec env MPICOMM_NETNS=loopback unshare -n bash -c 'ip link set lo up && exec "$0" "$@"' "$0" "$@"
fi
. .venv/bin/activate
export OMP_NUM_THREADS=1
all=(comm codecs decentralized centralized moniqua netvalidate tta bert hsq scaling moniqua-theta peers peers-apps
     step-overhead memory overlap)
chosen=("${@:-${all[@]}}")
for name in "${chosen[@]}"; do
  echo "== $name ($(date +%H:%M:%S))"
  case "$name" in
    comm) mpiexec -n 4 python bench/comm.py --repeat 41
          python bench/comm.py --compare-yield 4 --repeat 21 --rounds 3 ;;
    codecs) python bench/codecs.py --sizes 1M,16M --repeat 5 ;;
    decentralized|centralized|moniqua) mpiexec -n 4 python "bench/$name.py" ;;
    netvalidate) python bench/net_validate.py ;;
    tta) python bench/time_to_accuracy.py ;;
    bert) python bench/bert_speedup.py ;;
    hsq) python bench/hsq_wallclock.py ;;
    scaling) python bench/scaling.py ;;
    moniqua-theta) python bench/moniqua_theta_scale.py ;;
    peers) mpiexec -n 4 python bench/peers.py ;;
    peers-apps) python bench/peers_apps.py ;;
    step-overhead) mpiexec -n 4 python bench/step_overhead.py ;;
    memory) python bench/memory.py ;;
    overlap) python bench/overlap.py ;;
    *) echo "unknown benchmark '$name'; choose from: ${all[*]}" >&2; exit 2 ;;
  esac
done
echo "== done ($(date +%H:%M:%S))"
