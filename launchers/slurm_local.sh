#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for trying sweeps and for the tests.
#
#   sudo launchers/slurm_local.sh start    # install (Debian packages) if needed, configure, start
#   launchers/slurm_local.sh status         # sinfo + which daemons this script started
#   sudo launchers/slurm_local.sh stop     # stop only the daemons this script started
#
# Needs root on Debian/Ubuntu (apt, daemons running as root). Everything it writes lives in
# $RFT_SLURM_DIR (default /var/tmp/rft-slurm) plus /etc/slurm/slurm.conf and slurmdbd.conf, which it
# writes only if they are absent or were written by this script. It runs:
#   munged           authentication (as the munge user, Debian's key)
#   mariadbd         a private MariaDB on 127.0.0.1:$RFT_SLURM_DB_PORT (default 3307)
#   slurmdbd         accounting: without it `sacct` knows nothing and submitit waits forever on
#                    a job that died; with it a dead job is reported FAILED within seconds
#   slurmctld/slurmd the controller and the one compute node (partition `debug`)
# Jobs run as the submitting user in the directory they were submitted from.
set -euo pipefail

DIR=${RFT_SLURM_DIR:-/var/tmp/rft-slurm}
DB_PORT=${RFT_SLURM_DB_PORT:-3307}
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf  # slurmdbd reads it from beside slurm.conf, nowhere else
MARK="# written by rft launchers/slurm_local.sh"
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server-core mariadb-client-core)

say() { echo "slurm_local: $*"; }
die() { echo "slurm_local: $*" >&2; exit 1; }

# pid of a daemon this script started, if it is still alive
alive() {
    local f="$DIR/$1.pid"
    [[ -s $f ]] && kill -0 "$(cat "$f")" 2>/dev/null && cat "$f"
}

wait_for() {  # wait_for <seconds> <what> <command...>
    local secs=$1 what=$2
    shift 2
    for ((i = 0; i < secs * 2; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    die "$what did not come up within ${secs}s; its log is in $DIR/"
}

install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null || die "needs apt-get (Debian/Ubuntu) to install: ${missing[*]}"
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d 101: the packages must not start their own daemons (no systemd here, and we
    # start our own with our own config)
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
    fi
    apt-get install -y -q "${missing[@]}" >"$DIR/apt.log" 2>&1 ||
        { apt-get update -q >>"$DIR/apt.log" 2>&1 && apt-get install -y -q "${missing[@]}" >>"$DIR/apt.log" 2>&1; } ||
        { [[ $made_policy == 1 ]] && rm -f "$policy"; die "apt-get install failed; see $DIR/apt.log"; }
    [[ $made_policy == 1 ]] && rm -f "$policy"
    return 0
}

write_config() {
    local host node_line
    host=$(hostname -s)
    # the node's real hardware, or slurmctld drains it as "low socket*core*thread count"
    node_line=$(slurmd -C | head -1)
    [[ $node_line == NodeName=* ]] || die "slurmd -C did not describe this node: $node_line"
    for f in "$CONF" "$DBD_CONF"; do
        if [[ -e $f ]] && ! grep -qF "$MARK" "$f"; then
            die "$f exists and was not written by this script: this machine has its own Slurm. Use it (sinfo), or move the file away to let this script set up a local cluster."
        fi
    done
    mkdir -p /etc/slurm "$DIR/ctld" "$DIR/d"
    cat >"$CONF" <<EOF
$MARK; stop it with launchers/slurm_local.sh stop
ClusterName=rftlocal
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/d
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
# no cgroups: processes are tracked by their parent pids, tasks are not confined
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
# a finished job leaves squeue quickly; sacct keeps it
MinJobAge=30
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$DBD_CONF" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=rft-local
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DBD_CONF"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi  # one is running already
    [[ -s /etc/munge/munge.key ]] || /usr/sbin/mungekey --create >/dev/null
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    cp /run/munge/munged.pid "$DIR/munged.pid"
    wait_for 10 munged sh -c 'munge -n | unmunge'
}

start_db() {
    [[ -n $(alive mariadbd) ]] && return 0
    if [[ ! -d $DIR/mysql/mysql ]]; then
        mariadb-install-db --no-defaults --datadir="$DIR/mysql" --user=root --auth-root-authentication-method=socket >"$DIR/mariadb-install.log" 2>&1 ||
            die "mariadb-install-db failed; see $DIR/mariadb-install.log"
    fi
    # --no-defaults: nothing from the machine's /etc/mysql; a socket and a port of our own
    (mariadbd --no-defaults --datadir="$DIR/mysql" --user=root --socket="$DIR/mysql.sock" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DIR/mariadbd.pid" \
        --log-error="$DIR/mariadbd.log" --skip-name-resolve >/dev/null 2>&1 &)
    wait_for 60 mariadbd mariadb --no-defaults -S "$DIR/mysql.sock" -u root -e "select 1"
    mariadb --no-defaults -S "$DIR/mysql.sock" -u root -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'rft-local';
        CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

cmd_start() {
    [[ $(id -u) == 0 ]] || die "needs root (it installs packages and runs the daemons as root): sudo $0 start"
    mkdir -p "$DIR"
    install_packages
    write_config
    start_munge
    start_db
    if [[ -z $(alive slurmdbd) ]]; then
        slurmdbd
        wait_for 30 slurmdbd sacctmgr -n list cluster
    fi
    # the cluster must be known to the accounting database before slurmctld registers
    sacctmgr -i -n add cluster rftlocal >/dev/null 2>&1 || true
    if [[ -z $(alive slurmctld) ]]; then
        slurmctld -c -i  # -c: forget old jobs' state, -i: ignore state files' errors
    fi
    if [[ -z $(alive slurmd) ]]; then
        slurmd
    fi
    wait_for 60 "the node" sh -c 'sinfo -h -o %t | grep -qE "^(idle|mix|alloc)"'
    # a node drained by an earlier run (e.g. killed mid-job) would refuse jobs
    scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
    say "up: $(sinfo -h -o '%P %D node(s) %c CPUs %m MB %t')"
    say "try: srun hostname; sacct; state and logs in $DIR"
}

cmd_status() {
    for d in munged mariadbd slurmdbd slurmctld slurmd; do
        local pid
        pid=$(alive $d || true)
        if [[ -n $pid ]]; then say "$d: running, pid $pid"; else say "$d: not started by this script"; fi
    done
    sinfo 2>&1 || true
}

cmd_stop() {
    # the reverse order of start; only pids from our own pid files
    for d in slurmd slurmctld slurmdbd mariadbd munged; do
        local pid
        pid=$(alive $d || true)
        [[ -z $pid ]] && continue
        kill "$pid"
        for ((i = 0; i < 40; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        say "stopped $d (pid $pid)"
        rm -f "$DIR/$d.pid"
    done
    return 0
}

case ${1:-} in
start) cmd_start ;;
status) cmd_status ;;
stop) cmd_stop ;;
*) die "usage: $0 start|status|stop" ;;
esac
