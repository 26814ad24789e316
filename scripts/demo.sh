#!/usr/bin/env bash
# The main job on the embedded default: set up (once), then train ResNet-20 on 4 MPI ranks on the embedded
# digits data twice, with D-PSGD (fp32 gossip) and with Moniqua's default (4 bits on a rotating quarter of
# each tensor: ~1 bit per parameter), 10 epochs each; prints both test accuracies of the averaged model, the
# bytes each sent and their ratio. One to three minutes per run on 2 cores after set-up (more on a loaded machine).
# As root with `unshare`, MPI runs in a loopback-only network namespace (nothing leaves the machine).
# Extra arguments go to both runs, e.g. scripts/demo.sh --epochs 4 --seed 1
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${MPICOMM_NETNS:-}" ] && [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
   && unshare -n true 2>/dev/null; then
  MPICOMM_EXTRAS=${MPICOMM_EXTRAS:-mpi,apps} scripts/setup_env.sh
  exec env MPICOMM_NETNS=loopback unshare -n bash -c 'ip link set lo up && exec "$0" "$@"' "$0" "$@"
fi
MPICOMM_EXTRAS=${MPICOMM_EXTRAS:-mpi,apps} scripts/setup_env.sh >/dev/null
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
RANKS=${RANKS:-4}
. scripts/mpi_yield.sh
mpi_yield_if_oversubscribed "$RANKS"  # 4 ranks on fewer cores: let MPI's waiting ranks yield their core
run() {  # label, algorithm arguments...
  local label=$1; shift
  echo "== $label"
  mpiexec -n "$RANKS" python apps/train_resnet.py --model resnet20 --epochs 10 --lr 0.1 --momentum 0.9 \
    --no-progress --overwrite --out-dir "runs/demo/$label" "$@" "${EXTRA[@]}"
}
EXTRA=("$@")
run dpsgd --algorithm dpsgd
run moniqua --algorithm moniqua
python - <<'EOF'
import json
end = {}
for label in ("dpsgd", "moniqua"):
    with open(f"runs/demo/{label}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    end[label] = records[-1]
    end[label]["parameters"] = records[0]["parameters"]
d, m = end["dpsgd"], end["moniqua"]
bits = 8 * m["bytes_contributed"] / m["step"] / m["parameters"]
print(f"\nD-PSGD : test accuracy {100 * d['test_accuracy']:.1f} %, {d['bytes_sent'] / 1e6:7.1f} MB sent by rank 0")
print(f"Moniqua: test accuracy {100 * m['test_accuracy']:.1f} %, {m['bytes_sent'] / 1e6:7.1f} MB sent by rank 0 "
      f"({bits:.2f} bits per parameter per step, {m.get('moniqua_wrapped_parts', 0)} tensor parts skipped by the guard)")
print(f"Moniqua sent {d['bytes_sent'] / m['bytes_sent']:.1f}x fewer bytes than D-PSGD; accuracy difference "
      f"{100 * (m['test_accuracy'] - d['test_accuracy']):+.1f} points")
EOF
