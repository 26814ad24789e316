#!/usr/bin/env bash
# Real traffic shaping for an MPI job on one machine.
#
# Every MPI rank runs in its own network namespace (mcns-ID-rK, one veth "mc0" at 10.77.x.y/16), all
# veths joined by a bridge in a "switch" namespace (mcns-ID-sw, ports pK), and every rank's link is
# shaped in both directions at the --net bandwidth: egress on the rank's mc0 and ingress (the switch
# port's egress) on pK, so a rank's link is full duplex at BANDWIDTH each way, like a switched
# cluster (the picture of mpicomm/net/model.py). MPI is forced onto TCP over mc0 (MPICH: no
# shared-memory shortcut, ofi/tcp or ucx/tcp netmod); nothing is ever routed outside the namespaces
# this script creates.
#
# --net takes the project's network string (mpicomm.net.parse_net): "1gbit,100us", "100mbit,0us" or
# a named setting (fast, gbit, slow). Two networks: with --ranks-per-node K, consecutive ranks form nodes
# of K (exported as MPICOMM_RANKS_PER_NODE, so the apps' node layout is the shaped one) and --net may give
# two classes, "intra=10gbit,0us,inter=100mbit,0us": each rank link is then an htb with a class per link
# class, traffic to and from the ranks of its node (u32 filters on their addresses) at intra, everything
# else (other nodes) at inter -- only the cross-node links shaped to the slow network. Bandwidth is shaped with tbf. A latency > 0 is shaped with netem
# (half of it on each side of the bridge, so one rank-to-rank hop adds the full one-way latency) when
# the kernel has sch_netem; without it the latency is NOT shaped (one warning on stderr) and only the
# modelled path (--net on the apps, applied in the Communicator) covers latency.
#
# run/mpirun: the launcher (mpiexec) runs in a fresh loopback-only network namespace (unshare -n)
# unless MPICOMM_NETNS is already set; the ranks run in their own namespaces via the wrapper
# scripts/netshape_rank.sh (exported as MPICOMM_NETSHAPE_WRAP), which enters mcns-ID-r$PMI_RANK.
# Everything is torn down on exit, on error and on SIGINT/SIGTERM/SIGHUP (the command's process
# group and every process below it are killed, then anything left in the namespaces, then the
# namespaces). Bash cannot trap a signal that was ignored when it started: launched with `&` from a
# non-interactive shell, SIGINT is ignored, so stop such a run with SIGTERM. Needs root, ip, tc.
# The netem path (latency > 0 on a kernel with sch_netem) is untested where this was written (no netem).
#
#   scripts/netshape.sh mpirun --ranks 4 --net 1gbit,0us -- python bench/transport/comm.py
#   scripts/netshape.sh run --ranks 4 --net slow -- mpiexec -n 4 '$MPICOMM_NETSHAPE_WRAP' python x.py
#   scripts/netshape.sh mpirun --ranks 8 --ranks-per-node 2 --net intra=10gbit,0us,inter=1gbit,0us -- python x.py
#   scripts/netshape.sh up --ranks 2 --net 100mbit,0us --id demo; scripts/netshape.sh down --id demo
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"
WRAP="$HERE/netshape_rank.sh"
PREFIX=mcns-
MAX_RANKS=1024

usage() {
  cat <<EOF
usage: scripts/netshape.sh run    --ranks N --net SPEC [--id ID] [--] COMMAND...
       scripts/netshape.sh mpirun --ranks N --net SPEC [--id ID] [--] PROGRAM ARGS...
       scripts/netshape.sh up     --ranks N --net SPEC [--id ID]
       scripts/netshape.sh down   --id ID | --all
       scripts/netshape.sh status

  run     set up N rank namespaces joined by a shaped bridge, run COMMAND with the MPI environment
          exported (MPICOMM_NETSHAPE_WRAP = the per-rank wrapper; e.g.
          mpiexec -n N "\$MPICOMM_NETSHAPE_WRAP" python app.py), tear down, exit with its status
  mpirun  the same, running: mpiexec -n N <wrapper> PROGRAM ARGS...
  up      set up only (for manual use); prints the environment to export
  down    delete the namespaces (and kill their processes) of run ID, or of every run with --all
  status  list the mcns- namespaces and their qdiscs

  --ranks N    number of MPI ranks (1..$MAX_RANKS)
  --net SPEC   BANDWIDTH,LATENCY per rank link, e.g. 1gbit,100us; or fast, gbit, slow; with
               --ranks-per-node, intra=SPEC,inter=SPEC for inside a node and between nodes
  --ranks-per-node K
               emulated nodes of K consecutive ranks (N a multiple of K): traffic between ranks of
               one node at intra, the rest at inter; exported as MPICOMM_RANKS_PER_NODE
  --id ID      name of this run's namespaces (mcns-ID-...); default: this script's pid
Needs root, iproute2 (ip, tc) and, for run/mpirun, util-linux unshare.
EOF
}

die() { echo "netshape: $*" >&2; exit 2; }

require_tools() {
  [ "$(id -u)" = 0 ] || die "must run as root (creates network namespaces and qdiscs)"
  local tool
  for tool in ip tc; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found (install iproute2)"
  done
}

python_bin() {
  if [ -n "${MPICOMM_PYTHON:-}" ]; then echo "$MPICOMM_PYTHON"
  elif [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"
  else echo python3; fi
}

# parse_net SPEC -> sets NET_BITS (integer bit/s), NET_LAT_NS (integer ns) of the inter-node (or only)
# class, INTRA_BITS, INTRA_LAT_NS of the intra-node one (the same for a one-class SPEC), TWO_CLASSES (0/1)
# and NET_STR (canonical)
parse_net() {
  local spec=$1 out py
  py=$(python_bin)
  if ! out=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$py" -c '
import sys
from mpicomm.net import NetLinks, parse_net
try:
    s = parse_net(sys.argv[1])
except ValueError as e:
    sys.exit(str(e))
if s is None:
    sys.exit("--net: shaping needs a bandwidth, got %r (e.g. 1gbit,100us, fast, gbit, slow)" % sys.argv[1])
intra, inter = (s.intra, s.inter) if isinstance(s, NetLinks) else (s, s)
print(*(int(round(v)) for v in (inter.bits_per_s, inter.latency_s * 1e9, intra.bits_per_s,
                                intra.latency_s * 1e9)), int(isinstance(s, NetLinks)), s)
' "$spec" 2>&1); then
    out=${out##*$'\n'}
    die "invalid --net '$spec': ${out#--net: }"
  fi
  read -r NET_BITS NET_LAT_NS INTRA_BITS INTRA_LAT_NS TWO_CLASSES NET_STR <<<"$out"
  [ "$NET_BITS" -ge 8 ] && [ "$INTRA_BITS" -ge 8 ] \
    || die "invalid --net '$spec': bandwidth below 8 bit/s cannot be shaped"
  [ "$TWO_CLASSES" = 0 ] || [ -n "$PER_NODE" ] \
    || die "invalid --net '$spec': two link classes need --ranks-per-node (which ranks share a node)"
}

# ------------------------------------------------------------------ namespaces
list_ns() {  # list_ns [ID]: names of this run's namespaces (all mcns- ones without ID)
  local want=${1:+$PREFIX$1-}
  ip netns list 2>/dev/null | awk '{print $1}' | while read -r ns; do
    case "$ns" in "${want:-$PREFIX}"*) echo "$ns" ;; esac
  done
}

kill_ns_procs() {  # SIGKILL every process still inside namespace $1
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
}

delete_ns() {  # delete_ns NS...: kill what runs inside, then delete (takes veths and qdiscs with it)
  local ns
  for ns in "$@"; do kill_ns_procs "$ns"; done
  for ns in "$@"; do ip netns delete "$ns" 2>/dev/null || true; done
}

HRES=0  # 1 when the kernel has high-resolution timers
[ "$(awk '/resolution:/{print $2; exit}' /proc/timer_list 2>/dev/null)" != 1 ] || HRES=1
NETEM=unknown  # after the first shaped link: yes (latency shaped) or no (bandwidth only, warned)

burst_for() {  # burst_for BITS: the token-bucket burst, in bytes, for a rate of BITS bit/s
  local rate_bytes=$(( $1 / 8 )) burst
  # tbf burst: with high-resolution timers (tbf's watchdog is an hrtimer) 1 ms of traffic, clamped to
  # 32..256 KB, keeps the rate exact; the classic rule burst >= rate/HZ (HZ=250: 500 KB at 1gbit)
  # would let the first 500 KB of every message through at line speed (a 1 MB send at 1gbit took
  # 4.5 ms instead of 8). Without hrtimers, fall back to rate/250. MPICOMM_NETSHAPE_BURST overrides.
  if [ "$HRES" = 1 ]; then
    burst=$(( rate_bytes / 1000 )); [ "$burst" -le 262144 ] || burst=262144
  else
    burst=$(( rate_bytes / 250 ))
  fi
  [ "$burst" -ge 32768 ] || burst=32768
  echo "${MPICOMM_NETSHAPE_BURST:-$burst}"
}

no_latency_warning() {  # no_latency_warning TC_ERROR: once, say that latency is not shaped here
  NETEM=no
  echo "netshape: WARNING: latency ${NET_STR#*,} is NOT shaped here: this kernel has no sch_netem" \
       "(tc: ${1%%$'\n'*}); only the bandwidth is shaped. The modelled path (--net on the" \
       "apps, applied in the Communicator) covers latency." >&2
}

shape() {  # shape NS DEV: bandwidth (and, where possible, half the latency) on DEV's egress
  local ns=$1 dev=$2 rate_bytes burst limit half_us
  rate_bytes=$(( NET_BITS / 8 ))
  burst=$(burst_for "$NET_BITS")
  limit=$(( burst + rate_bytes / 20 )); [ "$limit" -ge 262144 ] || limit=262144  # ~50 ms of queue
  if [ "$NET_LAT_NS" -gt 0 ] && [ "$NETEM" != no ]; then
    half_us=$(( (NET_LAT_NS + 1999) / 2000 ))
    local err
    if err=$(tc -n "$ns" qdisc add dev "$dev" root netem delay "${half_us}us" rate "${NET_BITS}bit" \
             limit 100000 2>&1); then
      NETEM=yes
      return
    fi
    if [ "$NETEM" = yes ]; then die "tc netem on $ns/$dev failed: $err"; fi
    no_latency_warning "$err"
  fi
  tc -n "$ns" qdisc add dev "$dev" root tbf rate "${NET_BITS}bit" burst "$burst" limit "$limit"
}

shape_classes() {  # shape_classes NS DEV RANK DIR: htb, the ranks of RANK's node (matched as ip DIR) at
  # the intra class 1:10, everything else at the inter class 1:20 (each with half its latency, where
  # netem exists); DIR is dst on the rank's own egress, src on its switch port (the rank's ingress)
  local ns=$1 dev=$2 r=$3 dir=$4 class bits lat_ns err first p host
  tc -n "$ns" qdisc add dev "$dev" root handle 1: htb default 20
  for class in 10 20; do
    if [ "$class" = 10 ]; then bits=$INTRA_BITS lat_ns=$INTRA_LAT_NS; else bits=$NET_BITS lat_ns=$NET_LAT_NS; fi
    tc -n "$ns" class add dev "$dev" parent 1: classid "1:$class" htb rate "${bits}bit" \
      burst "$(burst_for "$bits")" cburst "$(burst_for "$bits")" quantum 60000
    if [ "$lat_ns" -gt 0 ] && [ "$NETEM" != no ]; then
      if err=$(tc -n "$ns" qdisc add dev "$dev" parent "1:$class" netem delay "$(( (lat_ns + 1999) / 2000 ))us" \
               limit 100000 2>&1); then
        NETEM=yes
      elif [ "$NETEM" = yes ]; then die "tc netem on $ns/$dev failed: $err"
      else no_latency_warning "$err"; fi
    fi
  done
  first=$(( r / PER_NODE * PER_NODE ))
  for (( p = first; p < first + PER_NODE; p++ )); do
    [ "$p" != "$r" ] || continue
    host=$(( p + 1 ))
    tc -n "$ns" filter add dev "$dev" parent 1: protocol ip prio 1 u32 \
      match ip "$dir" "10.77.$(( host / 256 )).$(( host % 256 ))/32" flowid 1:10
  done
}

setup() {  # setup ID N: the switch namespace, N rank namespaces, veths, addresses, qdiscs
  local id=$1 n=$2 sw="$PREFIX$1-sw" r ns host
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge
  ip -n "$sw" link set br0 up
  for (( r = 0; r < n; r++ )); do
    ns="$PREFIX$id-r$r"
    host=$(( r + 1 ))
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add mc0 netns "$ns" type veth peer name "p$r" netns "$sw"
    ip -n "$ns" addr add "10.77.$(( host / 256 )).$(( host % 256 ))/16" dev mc0
    ip -n "$ns" link set mc0 up
    ip -n "$sw" link set "p$r" master br0
    ip -n "$sw" link set "p$r" up
    if [ -n "$PER_NODE" ]; then
      shape_classes "$ns" mc0 "$r" dst      # the rank's egress
      shape_classes "$sw" "p$r" "$r" src    # the rank's ingress (switch port towards the rank)
    else
      shape "$ns" mc0       # the rank's egress
      shape "$sw" "p$r"     # the rank's ingress (switch port towards the rank)
    fi
  done
}

export_env() {  # export_env ID N: what MPICH needs to stay on TCP over mc0, and what the wrapper needs
  export MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=mc0 \
         UCX_TLS=tcp UCX_NET_DEVICES=mc0
  export MPICOMM_NETSHAPE_WRAP="$WRAP" MPICOMM_NETSHAPE_PREFIX="$PREFIX$1-r" MPICOMM_NETSHAPE_RANKS="$2" \
         MPICOMM_NETSHAPE_NET="$NET_STR"
  if [ -n "$PER_NODE" ]; then export MPICOMM_RANKS_PER_NODE="$PER_NODE"; fi
}

print_env() {
  local v
  for v in MPIR_CVAR_NOLOCAL MPIR_CVAR_CH4_NETMOD FI_PROVIDER FI_TCP_IFACE UCX_TLS UCX_NET_DEVICES \
           MPICOMM_NETSHAPE_WRAP MPICOMM_NETSHAPE_PREFIX MPICOMM_NETSHAPE_RANKS MPICOMM_NETSHAPE_NET \
           ${PER_NODE:+MPICOMM_RANKS_PER_NODE}; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done
}

# ------------------------------------------------------------------ argument parsing
RANKS="" NET="" ID="" ALL=0 CMD=() PER_NODE=""
parse_args() {  # parse_args SUBCOMMAND ARGS...
  local sub=$1; shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --ranks) [ $# -ge 2 ] || die "--ranks needs a value"; RANKS=$2; shift 2 ;;
      --ranks=*) RANKS=${1#*=}; shift ;;
      --net) [ $# -ge 2 ] || die "--net needs a value"; NET=$2; shift 2 ;;
      --net=*) NET=${1#*=}; shift ;;
      --id) [ $# -ge 2 ] || die "--id needs a value"; ID=$2; shift 2 ;;
      --ranks-per-node) [ $# -ge 2 ] || die "--ranks-per-node needs a value"; PER_NODE=$2; shift 2 ;;
      --ranks-per-node=*) PER_NODE=${1#*=}; shift ;;
      --id=*) ID=${1#*=}; shift ;;
      --all) ALL=1; shift ;;
      -h|--help) usage; exit 0 ;;
      --) shift; CMD=("$@"); break ;;
      -*) die "unknown option '$1' for $sub (see --help)" ;;
      *) CMD=("$@"); break ;;
    esac
  done
  if [ -n "$ID" ] && ! [[ "$ID" =~ ^[A-Za-z0-9_.]+$ ]]; then
    die "--id '$ID': use letters, digits, '_' and '.' only"
  fi
  case "$sub" in
    run|mpirun|up)
      [ -n "$RANKS" ] || die "--ranks is required for $sub"
      [[ "$RANKS" =~ ^[0-9]+$ ]] && [ "$((10#$RANKS))" -ge 1 ] && [ "$((10#$RANKS))" -le $MAX_RANKS ] \
        || die "--ranks must be an integer from 1 to $MAX_RANKS, got '$RANKS'"
      RANKS=$((10#$RANKS))
      if [ -n "$PER_NODE" ]; then
        [[ "$PER_NODE" =~ ^[0-9]+$ ]] && [ "$((10#$PER_NODE))" -ge 1 ] && [ $(( RANKS % 10#$PER_NODE )) = 0 ] \
          || die "--ranks-per-node must be a whole number >= 1 that divides --ranks $RANKS, got '$PER_NODE'"
        PER_NODE=$((10#$PER_NODE))
      fi
      [ -n "$NET" ] || die "--net is required for $sub (e.g. --net 1gbit,100us)"
      ;;
  esac
  case "$sub" in
    run|mpirun) [ ${#CMD[@]} -gt 0 ] || die "$sub needs a command after the options (see --help)" ;;
    up|down|status) [ ${#CMD[@]} -eq 0 ] || die "$sub takes no command, got '${CMD[*]}'" ;;
  esac
}

# ------------------------------------------------------------------ run / mpirun
CHILD="" TORN=0
any_alive() {  # any_alive PID...: true while one of them (a -PGID stands for a group) still exists
  local p
  for p in "$@"; do kill -0 -- "$p" 2>/dev/null && return 0; done
  return 1
}

descendants() {  # descendants PID: every process below PID (children, grandchildren, ...)
  local table frontier=" $1 " found="" pid ppid changed=1
  table=$(ps -e -o pid= -o ppid= 2>/dev/null || true)
  while [ "$changed" = 1 ]; do
    changed=0
    while read -r pid ppid; do
      case "$frontier" in *" $ppid "*) case "$frontier" in *" $pid "*) ;; *)
        frontier+="$pid "; found+="$pid "; changed=1 ;; esac ;; esac
    done <<<"$table"
  done
  echo "$found"
}
teardown() {
  [ "$TORN" = 0 ] || return 0
  TORN=1
  trap '' INT TERM HUP
  if [ -n "$CHILD" ]; then
    # hydra puts its proxy and every rank in process groups of their own: note all descendants first
    local procs i
    procs=$(descendants "$CHILD")
    kill -TERM -- "-$CHILD" 2>/dev/null || true
    for (( i = 0; i < 30; i++ )); do   # up to 3 s for the command to go, then SIGKILL
      any_alive "-$CHILD" $procs || break
      sleep 0.1
    done
    kill -KILL -- "-$CHILD" 2>/dev/null || true
    # shellcheck disable=SC2086
    [ -z "$procs" ] || kill -KILL $procs 2>/dev/null || true
  fi
  # shellcheck disable=SC2046
  delete_ns $(list_ns "$ID")
}

on_signal() {  # on_signal NAME NUMBER
  echo "netshape: $1 received: stopping the command and removing namespaces $PREFIX$ID-*" >&2
  teardown
  exit $(( 128 + $2 ))
}

cmd_run() {  # cmd_run SUBCOMMAND: run or mpirun (arguments already parsed)
  if [ -z "${MPICOMM_NETNS:-}" ]; then   # launcher into a loopback-only network namespace, same pid
    if command -v unshare >/dev/null 2>&1 && unshare -n true 2>/dev/null; then
      exec env MPICOMM_NETNS=loopback unshare -n bash -c 'ip link set lo up && exec "$0" "$@"' \
        "$SELF" "$@"
    fi
    echo "netshape: note: 'unshare -n' unavailable; the launcher runs in the current network namespace" >&2
  fi
  shift
  parse_net "$NET"
  if [ -z "$ID" ]; then ID=$$; [ -z "$(list_ns "$ID")" ] || ID="$$x$RANDOM"; fi
  [ -z "$(list_ns "$ID")" ] || die "namespaces $PREFIX$ID-* exist already (scripts/netshape.sh down --id $ID)"
  trap teardown EXIT
  trap 'on_signal SIGINT 2' INT
  trap 'on_signal SIGTERM 15' TERM
  trap 'on_signal SIGHUP 1' HUP
  setup "$ID" "$RANKS"
  export_env "$ID" "$RANKS"
  if [ "$SUB" = mpirun ]; then CMD=(mpiexec -n "$RANKS" "$WRAP" "${CMD[@]}"); fi
  echo "netshape: id $ID: $RANKS ranks at $NET_STR$([ "$NETEM" = no ] && echo ' (bandwidth only)'):" \
       "${CMD[*]}" >&2
  set -m            # the command gets its own process group, so teardown can kill all of it
  "${CMD[@]}" &
  CHILD=$!
  set +m
  local rc=0
  wait "$CHILD" || rc=$?
  teardown
  trap - EXIT
  exit "$rc"
}

# ------------------------------------------------------------------ main
[ $# -gt 0 ] || { usage >&2; exit 2; }
SUB=$1
case "$SUB" in
  -h|--help|help) usage; exit 0 ;;
  run|mpirun|up|down|status) ;;
  *) echo "netshape: unknown subcommand '$SUB'" >&2; usage >&2; exit 2 ;;
esac
parse_args "$@"
require_tools
case "$SUB" in
  run|mpirun) cmd_run "$@" ;;
  up)
    parse_net "$NET"
    ID=${ID:-$$}
    [ -z "$(list_ns "$ID")" ] || die "namespaces $PREFIX$ID-* exist already (scripts/netshape.sh down --id $ID)"
    trap 'delete_ns $(list_ns "$ID")' ERR
    setup "$ID" "$RANKS"
    trap - ERR
    export_env "$ID" "$RANKS"
    echo "netshape: id $ID: $RANKS ranks at $NET_STR; export this, run mpiexec -n $RANKS \"\$MPICOMM_NETSHAPE_WRAP\"" \
         "PROGRAM, then: scripts/netshape.sh down --id $ID" >&2
    print_env
    ;;
  down)
    if [ "$ALL" = 1 ]; then ID=""
    elif [ -z "$ID" ]; then die "down needs --id ID or --all"; fi
    mapfile -t doomed < <(list_ns "$ID")
    delete_ns "${doomed[@]}"
    echo "netshape: removed ${#doomed[@]} namespace(s)" >&2
    ;;
  status)
    mapfile -t present < <(list_ns "")
    [ ${#present[@]} -gt 0 ] || { echo "no $PREFIX namespaces"; exit 0; }
    for ns in "${present[@]}"; do
      case "$ns" in *-sw) dev=$(ip -n "$ns" -o link show master br0 2>/dev/null | awk -F': ' '{print $2}' \
                                | cut -d@ -f1 | tr '\n' ' ') ;; *) dev=mc0 ;; esac
      echo "$ns:"
      for d in $dev; do
        echo "  $d: $(tc -n "$ns" qdisc show dev "$d" 2>/dev/null | head -1)"
      done
    done
    ;;
esac
