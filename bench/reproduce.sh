#!/usr/bin/env bash
# Reproduce every table, plot and figure the README and docs/ quote, in order (a few hours on 2 cores).
#   bench/reproduce.sh                 # everything that runs on a CPU
#   bench/reproduce.sh tta bert        # only some (the names in `all` below; `gpu` needs a GPU)
# The scripts are grouped by what they measure: bench/transport, codecs, per_step, checkpoint, sharding, training,
# wallclock, gpu.
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
all=(comm codecs kernel-breakdown moniqua-pull decentralized centralized moniqua moniqua-adpsgd netvalidate tta bert
     hsq scaling moniqua-theta moniqua-resnet peers peers-apps export-batchnorm step-overhead host-syncs
     user-optimizer memory resize-memory sharding moniqua-rss overlap local-updates gossip-overlap hierarchy defaults
     bert-yardstick skewed one-peer-graphs moniqua-overlap)
chosen=("${@:-${all[@]}}")
for name in "${chosen[@]}"; do
  echo "== $name ($(date +%H:%M:%S))"
  case "$name" in
    comm) mpiexec -n 4 python bench/transport/comm.py --repeat 41
          python bench/transport/comm.py --compare-yield 4 --repeat 21 --rounds 3 ;;
    codecs) python bench/codecs/codecs.py --sizes 1M,16M --repeat 5 ;;
    kernel-breakdown) mpiexec -n 4 python bench/codecs/kernel_breakdown.py ;;
    moniqua-pull) python bench/codecs/moniqua_pull.py ;;
    decentralized|centralized|moniqua) mpiexec -n 4 python "bench/training/$name.py" ;;
    moniqua-adpsgd) mpiexec -n 4 python bench/training/moniqua_adpsgd.py ;;
    netvalidate) python bench/transport/net_validate.py ;;
    tta) python bench/wallclock/time_to_accuracy.py ;;
    bert) python bench/wallclock/bert_speedup.py ;;
    hsq) python bench/wallclock/hsq_wallclock.py ;;
    scaling) python bench/wallclock/scaling.py ;;
    moniqua-theta) python bench/training/moniqua_theta_scale.py ;;
    moniqua-resnet) python bench/wallclock/moniqua_resnet.py ;;
    peers) mpiexec -n 4 python bench/training/peers.py ;;
    peers-apps) python bench/wallclock/peers_apps.py ;;
    export-batchnorm) python bench/training/export_batchnorm.py --out-dir "${TMPDIR:-/tmp}/mpicomm-export-bn" ;;
    step-overhead) mpiexec -n 4 python bench/per_step/step_overhead.py ;;
    host-syncs) mpiexec -n 4 python bench/per_step/host_syncs.py ;;
    user-optimizer) mpiexec -n 2 python bench/per_step/user_optimizer.py ;;
    memory) python bench/per_step/memory.py ;;
    resize-memory) python bench/checkpoint/resize_memory.py --params 50 --pairs 8:4,4:8 ;;
    sharding) python bench/sharding/memory.py --rounds 6
              python bench/training/yardstick.py --ranks 4 --seeds 0,1,2,3,4,5,6,7,8,9 --epochs 10 --name sharding_yardstick \
                --methods allreduce_adam+lr=0.01,allreduce_adam+lr=0.01+shard,allreduce_adam+lr=0.01+shard+shard-bits=4,allreduce_adam+lr=0.01+shard+shard-bits=8
              python bench/sharding/onebit_bytes.py
              python bench/training/bert_yardstick.py --ranks 4 --seeds 0 --steps 600 --warmup 100 --name bert_sharded \
                --methods allreduce_adam+lr=2e-3,allreduce_adam+lr=2e-3+shard,apmsqueeze+lr=2e-3+shard,apmsqueeze+lr=2e-3+shard+gather-bits=8 ;;
    moniqua-rss) for algorithm in dpsgd moniqua; do mpiexec -n 4 python bench/per_step/moniqua_rss.py "$algorithm"; done ;;
    overlap) python bench/wallclock/overlap.py ;;
    local-updates) python bench/wallclock/local_updates.py ;;
    gossip-overlap) python bench/wallclock/overlap.py --algorithms dpsgd,moniqua,choco --models resnet20 --ranks 4 \
                      --steps 15 --rounds 3 --settings slow,gbit --name gossip_overlap ;;
    hierarchy) python bench/wallclock/hierarchy.py ;;
    defaults) python bench/training/defaults_sweep.py ;;
    bert-yardstick) python bench/training/bert_yardstick.py --methods allreduce_adam,apmsqueeze,onebit_lamb,zeroone_adam ;;
    skewed) python bench/training/yardstick.py --ranks 8 --seeds 0,1,2 --epochs 10 --name mnist1d_skewed \
              --methods dpsgd+dirichlet-alpha=0.1,d2+dirichlet-alpha=0.1,moniqua+dirichlet-alpha=0.1,moniqua_d2+dirichlet-alpha=0.1,moniqua_d2+bits=2+dirichlet-alpha=0.1,dpsgd+momentum=0+lr=0.25+dirichlet-alpha=0.1
            python bench/training/yardstick.py --ranks 8 --seeds 0,1,2 --epochs 10 --methods moniqua_d2+bits=2 --name mnist1d_d2_bits
            python bench/training/yardstick.py --ranks 8 --seeds 0 --epochs 10 --name mnist1d_adam_lr \
              --methods allreduce_adam,allreduce_adam+lr=3e-3,allreduce_adam+lr=1e-2 ;;
    one-peer-graphs) python bench/training/yardstick.py --ranks 8 --seeds 0,1,2 --epochs 10 --name one_peer_graphs \
              --methods dpsgd+topology=ring,dpsgd+topology=torus,dpsgd+topology=alternating_ring,dpsgd+topology=one_peer_hypercube,dpsgd+topology=one_peer_exponential ;;
    moniqua-overlap) python bench/wallclock/overlap.py --algorithms dpsgd,moniqua --models resnet20 --ranks 4 --steps 15 \
              --rounds 2 --settings slow --name moniqua_overlap
            python bench/wallclock/progress_overlap.py --algorithms moniqua,dpsgd --mechanisms none,thread --rounds 2 \
              --name moniqua_overlap_wire ;;
    gpu) scripts/gpu_check.sh ;;
    *) echo "unknown benchmark '$name'; choose from: ${all[*]}" >&2; exit 2 ;;
  esac
done
echo "== done ($(date +%H:%M:%S))"
