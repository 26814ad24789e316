#!/usr/bin/env bash
# A real single-node SLURM on this machine, for tests: munged + slurmctld + slurmd on loopback only.
#   scripts/slurm_local.sh COMMAND [ARGS...]   -> runs COMMAND with SLURM_CONF set while the cluster is up
# Needs root and Debian's slurmctld slurmd slurm-client munge (scripts/install_slurm.sh installs them).
# Runs inside a loopback-only network namespace (a new one, unless already inside one: MPICOMM_NETNS).
# Exit status: COMMAND's; 90-93 when the cluster could not be brought up.
set -euo pipefail
if [ "${MPICOMM_NETNS:-}" != loopback ]; then
  exec env MPICOMM_NETNS=loopback unshare -n bash -c 'ip link set lo up && exec "$0" "$@"' "$0" "$@"
fi
RUN=$(mktemp -d /tmp/mpicomm-slurm.XXXXXX)
chmod 755 "$RUN"
mkdir -p "$RUN"/{state,spool,log,munge}
chown munge:munge "$RUN/munge"; chmod 755 "$RUN/munge"        # munged wants a+x on its socket dir
dd if=/dev/urandom of="$RUN/munge/munge.key" bs=128 count=1 status=none
chown munge:munge "$RUN/munge/munge.key"; chmod 400 "$RUN/munge/munge.key"
# cred_expire=30: a requeued job waits out its credential lifetime before it runs again (120 s by default);
# the preemption test waits for that rather than releasing the job early, which hit the revoked credential.
# sched_interval/bf_interval=2: the requeued job starts within 2 s of becoming eligible (the main scheduling
# pass runs every 60 s by default, and an eligible job waited for it).
# CPUs: at least 4, so a 4-task job fits on this one node whatever its core count (config_overrides: slurmd
# takes the configured count rather than draining the node for having fewer cores than configured).
CPUS=$(getconf _NPROCESSORS_ONLN); [ "$CPUS" -ge 4 ] || CPUS=4
cat > "$RUN/slurm.conf" <<CONF
ClusterName=mpicomm
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$RUN/munge/munge.socket,cred_expire=30
StateSaveLocation=$RUN/state
SlurmdSpoolDir=$RUN/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$RUN/log/slurmctld.log
SlurmdLogFile=$RUN/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
ReturnToService=2
MinJobAge=600
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
# cgroup autodetection fails in containers ("No filesystem mounted on /sys/fs/cgroup"): name v1 explicitly
printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n' > "$RUN/cgroup.conf"
export SLURM_CONF=$RUN/slurm.conf
# glibc's AI_ADDRCONFIG ignores 127.0.0.1; a second loopback address makes getaddrinfo("localhost") work
ip addr add 127.0.0.2/8 dev lo 2>/dev/null || true

teardown() {
  # end every job first: slurmd's shutdown leaves running job steps (and their MPI ranks) behind
  scancel --full --quiet --user=root >/dev/null 2>&1 || true
  for _ in $(seq 1 60); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
  scontrol shutdown >/dev/null 2>&1 || true
  for _ in $(seq 1 50); do
    pgrep -F "$RUN/slurmctld.pid" >/dev/null 2>&1 || pgrep -F "$RUN/slurmd.pid" >/dev/null 2>&1 || break
    sleep 0.2
  done
  kill "$(cat "$RUN/munge/munged.pid" 2>/dev/null)" 2>/dev/null || true
  rm -rf "$RUN"
}
trap teardown EXIT
runuser -u munge -- /usr/sbin/munged --socket="$RUN/munge/munge.socket" --key-file="$RUN/munge/munge.key" \
  --pid-file="$RUN/munge/munged.pid" --log-file="$RUN/munge/munged.log" --seed-file="$RUN/munge/munged.seed" \
  || exit 90
slurmctld -c || exit 91
slurmd -N localhost || exit 92
for _ in $(seq 1 100); do
  [ "$(timeout 5 sinfo -h -o %T 2>/dev/null)" = idle ] && break
  sleep 0.2
done
if [ "$(timeout 5 sinfo -h -o %T 2>/dev/null)" != idle ]; then
  echo "slurm_local: the cluster did not come up"; tail -5 "$RUN"/log/*.log; exit 93
fi
echo "slurm_local: cluster up ($(sinfo -h -o '%P %T %D %N %c CPUs'))"
set +e
"$@"
