#!/usr/bin/env bash
# A real, small Slurm cluster on this one machine, for monarch-cli's tests and for trying
# the Slurm backend by hand.
#
#   scripts/slurm-cluster.sh start [NODES]   install (apt) if needed, start; idempotent
#   scripts/slurm-cluster.sh stop            stop everything this script started; idempotent
#   scripts/slurm-cluster.sh status          print the nodes; exit 0 when every node is usable
#
# How: slurmctld runs on this machine as it is. Each compute node (mnode1, mnode2, ...) is
# a slurmd in its own network namespace (its own IP on a private bridge, its own port 6818)
# and its own UTS namespace (its own hostname), so jobs really span several hosts with
# different addresses, while all of them share this machine's filesystem (a "shared
# filesystem", as on a real cluster). Needs root, Debian packages slurmctld, slurmd,
# slurm-client and munge (installed here with apt-get when missing), and iproute2.
# The config is /etc/slurm/slurm.conf; an existing one that this script did not write is
# left alone and `start` fails. See docs/slurm.md.
set -euo pipefail

NODES_DEFAULT=2
MARK="# monarch-cli test cluster (scripts/slurm-cluster.sh)"
CONF=/etc/slurm/slurm.conf
BASE=/var/lib/monarch-slurm
RUN=/run/monarch-slurm
LOGS=/var/log/monarch-slurm
BRIDGE=monarch-br0
NET=10.213.0            # private test subnet: the bridge is .1, node i is .(10+i)
HOSTS_BEGIN="# monarch-slurm begin"
HOSTS_END="# monarch-slurm end"

say() { echo "slurm-cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it installs packages and creates network namespaces)"; }

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    command -v ip >/dev/null || missing+=(iproute2)
    command -v nsenter >/dev/null || missing+=(util-linux)
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing ${missing[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >"$LOGS/apt.log" 2>&1 || { tail -5 "$LOGS/apt.log" >&2; die "apt-get update failed (log: $LOGS/apt.log)"; }
    apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$LOGS/apt.log" 2>&1 \
        || { tail -5 "$LOGS/apt.log" >&2; die "apt-get install ${missing[*]} failed (log: $LOGS/apt.log)"; }
}

start_munge() {
    if [ -S /run/munge/munge.socket.2 ] && pgrep -x munged >/dev/null; then return 0; fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
    if [ ! -s /etc/munge/munge.key ]; then
        if command -v mungekey >/dev/null; then mungekey --create --force >/dev/null 2>&1
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    fi
    chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
    chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged || die "munged did not start (see /var/log/munge/munged.log)"
    touch "$RUN/munged.ours"
}

node_names() { local i; for i in $(seq 1 "$1"); do echo "mnode$i"; done; }

write_conf() {
    local n=$1 ctl cpus
    ctl=$(hostname -s)
    cpus=4  # per node; more than the machine has, so several small jobs can share a node
    if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; not touching a real cluster's config"
    fi
    mkdir -p /etc/slurm
    {
        echo "$MARK"
        echo "ClusterName=monarch-test"
        echo "SlurmctldHost=$ctl($NET.1)"
        echo "SlurmUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        echo "StateSaveLocation=$BASE/ctld"
        echo "SlurmdSpoolDir=$BASE/slurmd-%n"
        echo "SlurmctldPidFile=$RUN/slurmctld.pid"
        echo "SlurmdPidFile=$RUN/slurmd-%n.pid"
        echo "SlurmctldLogFile=$LOGS/slurmctld.log"
        echo "SlurmdLogFile=$LOGS/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobCompType=jobcomp/none"
        echo "MpiDefault=none"
        echo "MailProg=/bin/true"
        echo "SwitchType=switch/none"
        echo "SchedulerType=sched/backfill"
        echo "SchedulerParameters=sched_interval=2,bf_interval=2"  # a pending job starts within seconds
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SlurmdParameters=config_overrides"
        echo "ReturnToService=2"
        echo "SlurmdTimeout=30"
        echo "KillWait=5"
        echo "MinJobAge=600"
        echo "JobSubmitPlugins=lua"
        echo "InactiveLimit=0"
        echo "MaxJobCount=10000"
        # Nodes, each a slurmd in its own network namespace on the bridge.
        local i
        for i in $(seq 1 "$n"); do
            echo "NodeName=mnode$i NodeAddr=$NET.$((10 + i)) NodeHostname=mnode$i CPUs=$cpus RealMemory=4000 State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    write_job_submit
}

# Without slurmdbd, Slurm knows no accounts and takes any --account. A site submit filter
# (job_submit/lua, a standard Slurm plugin) stands in for accounting here: it refuses
# unknown accounts with the very error sbatch prints on a cluster with accounting.
write_job_submit() {
    cat >/etc/slurm/job_submit.lua.tmp <<LUA
-- $MARK
local known = { research = true, monarch = true }
function slurm_job_submit(job_desc, part_list, submit_uid)
    if job_desc.account ~= nil and not known[job_desc.account] then
        slurm.log_user("unknown account '%s' (known here: monarch, research)", job_desc.account)
        return slurm.ESLURM_INVALID_ACCOUNT
    end
    return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end
return slurm.SUCCESS
LUA
    mv /etc/slurm/job_submit.lua.tmp /etc/slurm/job_submit.lua
}

write_hosts() {
    local n=$1 i tmp
    tmp=$(mktemp)
    sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" /etc/hosts >"$tmp"
    {
        echo "$HOSTS_BEGIN"
        echo "$NET.1 monarch-login"  # this machine as the nodes see it (reverse lookups must not hit DNS)
        for i in $(seq 1 "$n"); do echo "$NET.$((10 + i)) mnode$i"; done
        echo "$HOSTS_END"
    } >>"$tmp"
    cat "$tmp" >/etc/hosts  # in place: /etc/hosts may be a bind mount
    rm -f "$tmp"
}

setup_network() {
    local n=$1 i ns
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$NET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    for i in $(seq 1 "$n"); do
        ns="monarch-mnode$i"
        [ -e "/run/netns/$ns" ] || ip netns add "$ns"
        # No DNS server is reachable from a node: make lookups that miss /etc/hosts fail at
        # once instead of timing out (torch's c10d looks up every peer's address).
        mkdir -p "/etc/netns/$ns"
        printf '%s\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n' "$MARK" >"/etc/netns/$ns/resolv.conf"
        if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
            ip link del "mveth$i" 2>/dev/null || true
            ip link add "mveth$i" type veth peer name "mveth$i-n"
            ip link set "mveth$i-n" netns "$ns"
            ip -n "$ns" link set "mveth$i-n" name eth0
            ip -n "$ns" addr add "$NET.$((10 + i))/24" dev eth0
            ip link set "mveth$i" master "$BRIDGE"
            ip link set "mveth$i" up
            ip -n "$ns" link set lo up
            ip -n "$ns" link set eth0 up
            ip -n "$ns" route add default via "$NET.1"
        fi
    done
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_daemons() {
    local n=$1 i node
    mkdir -p "$BASE/ctld"
    if ! pid_alive "$RUN/slurmctld.pid"; then
        slurmctld -f "$CONF" || die "slurmctld did not start; see $LOGS/slurmctld.log"
    else
        scontrol reconfigure >/dev/null 2>&1 || true
    fi
    for i in $(seq 1 "$n"); do
        node="mnode$i"
        mkdir -p "$BASE/slurmd-$node"
        pid_alive "$RUN/slurmd-$node.pid" && continue
        # Its own network and UTS namespace (own IP, own port 6818, own hostname) and a
        # mount namespace only to give it the node's resolv.conf; the files are all shared.
        nsenter --net="/run/netns/monarch-$node" unshare --uts --mount --propagation slave \
            sh -c "mount --bind /etc/netns/monarch-$node/resolv.conf /etc/resolv.conf && hostname $node && exec slurmd -f $CONF -N $node" \
            || die "slurmd $node did not start; see $LOGS/slurmd-$node.log"
    done
}

wait_ready() {
    local n=$1 deadline states
    deadline=$((SECONDS + 90))
    until scontrol ping >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "slurmctld does not answer; see $LOGS/slurmctld.log"
        sleep 0.5
    done
    while :; do
        states=$(sinfo -h -N -p debug -o "%N %T" 2>/dev/null || true)
        if [ "$(echo "$states" | grep -cE ' (idle|allocated|mixed|completing)$')" -ge "$n" ]; then
            return 0
        fi
        # A node left down or drained by an earlier run (slurmd restarted): put it back.
        for node in $(echo "$states" | awk '$2 ~ /down|drain|fail/ {print $1}'); do
            scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
        done
        [ $SECONDS -lt $deadline ] || { echo "$states" >&2; die "nodes not ready in 90 s; see $LOGS/"; }
        sleep 0.5
    done
}

cmd_start() {
    local n=${1:-$NODES_DEFAULT}
    need_root
    [[ "$n" =~ ^[1-9][0-9]?$ ]] || die "NODES must be a number from 1 to 99, not '$n'"
    mkdir -p "$RUN" "$LOGS" "$BASE"
    if [ -f "$BASE/nodes" ] && [ "$(cat "$BASE/nodes")" != "$n" ] && pid_alive "$RUN/slurmctld.pid"; then
        say "running with $(cat "$BASE/nodes") node(s); restarting with $n"
        cmd_stop
        mkdir -p "$RUN" "$LOGS" "$BASE"
    fi
    install_packages
    start_munge
    write_conf "$n"
    write_hosts "$n"
    setup_network "$n"
    echo "$n" >"$BASE/nodes"
    start_daemons "$n"
    wait_ready "$n"
    say "up: $n node(s) ($(node_names "$n" | paste -sd, -)), partition debug; config $CONF"
}

kill_pidfile() {
    local f=$1 pid i
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

cmd_stop() {
    need_root
    local i
    if pid_alive "$RUN/slurmctld.pid"; then
        local jobs; jobs=$(squeue -h -o %i 2>/dev/null || true)
        [ -n "$jobs" ] && scancel --full $jobs >/dev/null 2>&1 || true
        sleep 1
    fi
    for f in "$RUN"/slurmd-*.pid; do [ -e "$f" ] && kill_pidfile "$f"; done
    kill_pidfile "$RUN/slurmctld.pid"
    # Whatever still runs inside a node's namespace (job steps that outlived slurmd).
    for i in $(seq 1 99); do
        [ -e "/run/netns/monarch-mnode$i" ] || continue
        local pids; pids=$(ip netns pids "monarch-mnode$i" 2>/dev/null || true)
        [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
    done
    if [ -f "$RUN/munged.ours" ]; then
        kill_pidfile /run/munge/munged.pid
        rm -f "$RUN/munged.ours"
    fi
    for i in $(seq 1 99); do
        [ -e "/run/netns/monarch-mnode$i" ] && ip netns del "monarch-mnode$i"
        rm -rf "/etc/netns/monarch-mnode$i"
        ip link del "mveth$i" >/dev/null 2>&1 || true
    done
    ip link del "$BRIDGE" >/dev/null 2>&1 || true
    if grep -q "^$HOSTS_BEGIN\$" /etc/hosts 2>/dev/null; then
        local tmp; tmp=$(mktemp)
        sed "/^$HOSTS_BEGIN\$/,/^$HOSTS_END\$/d" /etc/hosts >"$tmp" && cat "$tmp" >/etc/hosts
        rm -f "$tmp"
    fi
    # The controller's state stays: job ids keep counting up across restarts, so a
    # `monarch status --job ID` never finds an older job's files under a reused id.
    rm -rf "$BASE"/slurmd-* "$BASE/nodes"
    say "stopped"
}

cmd_status() {
    if ! command -v sinfo >/dev/null; then say "not installed"; return 1; fi
    if ! pid_alive "$RUN/slurmctld.pid"; then say "not running"; return 1; fi
    local n; n=$(cat "$BASE/nodes" 2>/dev/null || echo 0)
    sinfo -N -o "%N %P %T %c" 2>&1
    [ "$(sinfo -h -N -p debug -o "%T" 2>/dev/null | grep -cE '^(idle|allocated|mixed|completing)$')" -ge "$n" ]
}

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start [NODES] | stop | status" >&2; exit 2 ;;
esac
