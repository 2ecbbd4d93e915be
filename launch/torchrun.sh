#!/usr/bin/env bash
# Start the trainer on this node under torchrun: one process per GPU (or --nproc CPU processes).
#
#   launch/torchrun.sh [launcher options] --config yaml/X.yaml [key=value ...]
#
#   launch/torchrun.sh --config yaml/gsm8k_qwen2.5_0.5b.yaml actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct
#   launch/torchrun.sh --nproc 2 --config yaml/cpu_demo.yaml                 # CPU: 2 processes, gloo
#   # two nodes by hand: the same command on each, with that node's --node-rank
#   launch/torchrun.sh --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 --config ...
#
# Launcher options (each also an environment variable; the option wins):
#   --nproc N | --gpus N   NPROC_PER_NODE  processes on this node          default: the visible GPUs
#   --nnodes N             NNODES          nodes in the job                default: 1
#   --node-rank R          NODE_RANK       this node (0 hosts the rendezvous) default: $SLURM_NODEID or 0
#   --master-addr HOST     MASTER_ADDR     node 0's hostname or IP         default: 127.0.0.1
#   --master-port PORT     MASTER_PORT     rendezvous port on node 0       default: 29500 (one node without
#                                                                          a port given: a free port, --standalone)
#   --rdzv-id ID           RDZV_ID         same on every node of one job   default: megatron-rl
#   --log-dir DIR          LOG_DIR         node logs: DIR/node<R>.log      default: outputs/launch/<date-time>
#   --max-restarts N       MAX_RESTARTS    restart the node's ranks after a failure (a rank killed, a
#                                          collective timeout), each time resuming from the last
#                                          checkpoint (trainer.resume_mode=auto)   default: 0
#                          ENTRY           what torchrun runs              default: -m megatron_rl.train
#                          PYTHON          interpreter                     default: .venv/bin/python, else python3
#                          MEGATRON_RL_JOB_SECRET  the job's secret (below)  default: one node: random,
#                                          new for each torchrun start; several nodes: none (set it)
# Everything else is passed to the trainer (--config and key=value overrides).
#
# The job's secret: roles on ranks of their own (trainer.placement) sign every message they leave in the
# job's store with it (HMAC-SHA256), and refuse one that is not signed with it. It reaches the ranks in
# their environment, never the command line or the store. Unset, this script makes a random one for each
# torchrun it starts on one node. Several nodes must share one: set MEGATRON_RL_JOB_SECRET to the same
# random value on every node (launch/slurm.sbatch does); without it, ranks that need it stop at start in
# one line naming the variable.
#
# The rendezvous is torch's c10d store, hosted by node 0 (is_host is set explicitly, so a busy port fails
# at once instead of joining a stranger's store, and no hostname guessing decides who hosts). Node 0
# checks the port before starting. Exit status: 0 when every local rank succeeded, otherwise torchrun's
# (non-zero); the last line then says what failed and what to change
# ("megatron-rl: node R failed (exit N): ...").
#
# Stopping: send SIGTERM, SIGINT (Ctrl-C) or SIGUSR2 to this script (Slurm: see launch/slurm.sbatch). It
# forwards the signal once to torchrun, which forwards it to the ranks; they finish the current step,
# save a checkpoint ("megatron-rl: received SIGTERM at step N; saved <path>; exiting ...") and exit. The
# script then prints "megatron-rl: node R stopped by SIGTERM ..." and exits 128 + the signal number (143,
# 130, 140). torchrun gives the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default here 600) before
# SIGKILL. A second Ctrl-C kills torchrun at once, and the ranks with it (they never outlive torchrun).
# torchrun runs in its own session, so a terminal's Ctrl-C reaches the ranks only through this script.
#
# Recovery: with --max-restarts N, this script starts torchrun again (up to N times) when it fails (a
# rank killed, a collective timeout); the ranks resume from the newest checkpoint (trainer.resume_mode=
# auto, the default), so a failure loses at most the steps since the last save (trainer.save_freq). On
# several nodes every node's torchrun ends with the failure and every node's launcher restarts its
# own: give each the same N. A stop signal is never restarted.
#
# Re-placement: SIGUSR1 to this script (Slurm: scancel --signal=USR1 <job>) is forwarded the same way;
# the ranks finish their step, save a checkpoint and exit, and the script starts torchrun again with
# the same arguments: the new ranks resume from that checkpoint (trainer.resume_mode=auto) and read
# trainer.placement.file anew, so editing that file first moves ranks between roles (docs/placement.md);
# rank 0 then prints one line with the new placement. A stop signal (TERM, INT, USR2) during a
# re-placement outranks it: the job stops instead of restarting (so do the ranks among themselves).
# torchrun's own traceback for the signal it was sent (SignalException) is left out of the output.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# ---- NCCL / torch environment: defaults, each overridable from the environment -------------------------
# NVLink multicast (NVLS / symmetric-memory multicast) stays OFF: on shared GPU hosts a program using it
# can take the host's GPUs out of service. Keep these three at their defaults unless you own the host.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
# A collective that times out aborts its process (and so the job) instead of hanging with the GPUs held.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
# NCCL's own log level: WARN keeps errors visible; INFO shows the chosen transports (IB, NVLink, sockets).
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Megatron orders tensor-parallel communication behind compute on a single CUDA stream connection.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# One OpenMP thread per rank (torchrun's default, made explicit): ranks share the node's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
# torchrun forwards these to its ranks (SIGUSR2 too: Slurm's warning before the time limit), and waits
# this long for them to save and exit before SIGKILL.
export TORCHELASTIC_SIGNALS_TO_HANDLE="${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"
export PYTHONUNBUFFERED=1
# Multi-node networks: set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (e.g. ib0, eth0) and NCCL_IB_HCA
# when the hosts have several interfaces; they pass through unchanged.

# ---- launcher options ------------------------------------------------------------------------------------
PORT_GIVEN="${MASTER_PORT:+1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-megatron-rl}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
SECRET_GIVEN="${MEGATRON_RL_JOB_SECRET:+1}"
LOG_DIR="${LOG_DIR:-outputs/launch/$(date +%Y%m%d-%H%M%S)}"
ENTRY="${ENTRY:--m megatron_rl.train}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

die() { echo "megatron-rl error: $*" >&2; exit 2; }
need() { [[ $# -ge 2 && -n "$2" ]] || die "launcher option $1 needs a value."; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nproc|--gpus|--nproc-per-node|--nproc_per_node) need "$@"; NPROC_PER_NODE="$2"; shift 2 ;;
        --nnodes) need "$@"; NNODES="$2"; shift 2 ;;
        --node-rank|--node_rank) need "$@"; NODE_RANK="$2"; shift 2 ;;
        --master-addr|--master_addr) need "$@"; MASTER_ADDR="$2"; shift 2 ;;
        --master-port|--master_port) need "$@"; MASTER_PORT="$2"; PORT_GIVEN=1; shift 2 ;;
        --rdzv-id) need "$@"; RDZV_ID="$2"; shift 2 ;;
        --log-dir) need "$@"; LOG_DIR="$2"; shift 2 ;;
        --max-restarts|--max_restarts) need "$@"; MAX_RESTARTS="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
done
[[ $# -gt 0 ]] || die "no trainer arguments: pass --config yaml/X.yaml [key=value ...] (see --help)."

if [[ -z "$NPROC_PER_NODE" ]]; then
    # One process per visible GPU; CUDA_VISIBLE_DEVICES restricts what nvidia-smi lists.
    gpus=0
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        IFS=, read -r -a devs <<< "$CUDA_VISIBLE_DEVICES"; gpus=${#devs[@]}
    elif command -v nvidia-smi > /dev/null 2>&1; then
        gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
    fi
    [[ "$gpus" -gt 0 ]] || die "no GPU visible on $(hostname): pass --nproc N to run N CPU processes" \
        "(with trainer.device=cpu or auto), or run on a GPU node."
    NPROC_PER_NODE=$gpus
fi
for v in NPROC_PER_NODE NNODES NODE_RANK MASTER_PORT MAX_RESTARTS; do
    [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v=${!v} is not a number."
done
[[ "$NPROC_PER_NODE" -ge 1 && "$NNODES" -ge 1 ]] || die "--nproc and --nnodes must be at least 1."
[[ "$NODE_RANK" -lt "$NNODES" ]] || die "node rank $NODE_RANK is not below the number of nodes $NNODES."
export MASTER_ADDR MASTER_PORT  # read by explain-log's messages

mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/node${NODE_RANK}.log"
: > "$LOG"

args=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --max-restarts 0
      --signals-to-handle "$TORCHELASTIC_SIGNALS_TO_HANDLE" --shutdown-timeout "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
if [[ "$NNODES" == 1 && -z "$PORT_GIVEN" ]]; then
    args+=(--standalone)  # one node: torchrun picks a free port itself
    rdzv="local"
else
    rdzv="$MASTER_ADDR:$MASTER_PORT"
    if [[ "$NODE_RANK" == 0 ]]; then
        # Fails with one line if the port is taken or MASTER_ADDR is not this machine.
        PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron_rl.run.launch_checks port \
            "$MASTER_ADDR" "$MASTER_PORT" 2>&1 | tee -a "$LOG" >&2
        [[ "${PIPESTATUS[0]}" == 0 ]] || exit 1
        is_host=1
    else
        is_host=0
    fi
    args+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
           --rdzv-conf "is_host=$is_host")
fi
read -r -a entry <<< "$ENTRY"

echo "megatron-rl: node $NODE_RANK of $NNODES on $(hostname): $NPROC_PER_NODE process(es)," \
     "rendezvous $rdzv, log $LOG" | tee -a "$LOG"
# torchrun's output goes to the terminal and the node log through a FIFO and tee; tee ignores the stop
# signals (a tee killed by a signal sent to the whole job would break the ranks' output mid-save).
fifo_dir="$(mktemp -d "${TMPDIR:-/tmp}/megatron-rl-launch.XXXXXX")"
trap 'rm -rf "$fifo_dir"' EXIT
mkfifo "$fifo_dir/out"

pid=""
stop_sig=""
forward() {  # $1: TERM | INT | USR2 | USR1 (a HUP is forwarded as TERM: the ranks save on TERM)
    [[ -n "$pid" ]] || exit $((128 + $(kill -l "$1")))
    if [[ -n "$stop_sig" ]]; then
        if [[ "$stop_sig" == USR1 && "$1" != USR1 ]]; then  # a stop outranks a re-placement
            stop_sig="$1"
            echo "megatron-rl: node $NODE_RANK received SIG$1 during a re-placement: stopping instead of" \
                 "restarting" | tee -a "$LOG" >&2
            return
        fi
        if [[ "$1" == INT ]]; then
            echo "megatron-rl: node $NODE_RANK: second SIGINT: killing torchrun (pid $pid) and its ranks now" \
                | tee -a "$LOG" >&2
            kill -KILL "$pid" 2> /dev/null
        fi
        return  # one stop request is enough: a repeat would cut torchrun's own graceful shutdown short
    fi
    stop_sig="$1"
    local then="exit"
    [[ "$1" == USR1 ]] && then="restart with trainer.placement.file read anew"
    echo "megatron-rl: node $NODE_RANK received SIG$1; forwarded to torchrun (pid $pid): the ranks finish" \
         "their step, save a checkpoint and $then (SIGKILL after ${TORCH_ELASTIC_SHUTDOWN_TIMEOUT}s)" \
        | tee -a "$LOG" >&2
    kill -"$1" "$pid" 2> /dev/null
}
for sig in TERM INT USR2 USR1; do
    trap "forward $sig" "$sig"
done
trap "forward TERM" HUP
# A script started in the background of another script (`cmd &`, nohup) inherits SIGINT ignored, and bash
# cannot trap a signal ignored at entry: say so rather than let a Ctrl-C-style stop do nothing.
if [[ "$(trap -p INT)" == "trap -- '' SIGINT" ]]; then
    echo "megatron-rl: node $NODE_RANK: SIGINT is ignored in this shell (started in the background or" \
         "under nohup), so it cannot stop the job: use SIGTERM (kill -TERM $$), which saves and exits" \
        | tee -a "$LOG" >&2
fi

# torchrun answers the signal it forwards with a traceback of its own (SignalException: Process N got
# signal: S): routine here, so it is left out (the launcher's lines say what happened; the node log keeps
# it); every other line and traceback passes unchanged.
quiet_signal_traceback='
import sys
out, block = sys.stdout.buffer, []
def flush():
    out.writelines(block); block.clear(); out.flush()
for line in iter(sys.stdin.buffer.readline, b""):
    if line.rstrip() == b"Traceback (most recent call last):":
        flush(); block.append(line); continue
    if block and line[:1] in (b" ", b"\t"):
        block.append(line); continue
    if block and b"SignalException: Process " in line and b" got signal: " in line:
        block.clear(); continue
    block.append(line); flush()
flush()
'

# torchrun lives in a session of its own (above), so a launcher killed by SIGKILL (which it cannot
# trap and forward) would leave it and its ranks training, holding the run directory's lock. The kernel
# sends torchrun SIGTERM when this script dies (PR_SET_PDEATHSIG, kept across exec): the ranks save and
# exit as for a forwarded stop. Exits at once if the launcher ($1) is already gone.
tied_to_launcher='
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("megatron-rl: the launcher died before torchrun started")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
'

new_secret() {  # 32 random bytes as hex
    od -An -v -tx1 -N32 /dev/urandom | tr -d ' \n'
}

run_torchrun() {  # one torchrun; sets rc
    if [[ -z "$SECRET_GIVEN" && "$NNODES" == 1 ]]; then  # a new store each start: a new secret with it
        MEGATRON_RL_JOB_SECRET="$(new_secret)"
        export MEGATRON_RL_JOB_SECRET
    fi
    (trap '' TERM INT USR2 USR1 HUP; tee -a "$LOG" < "$fifo_dir/out" | "$PYTHON" -u -c "$quiet_signal_traceback") &
    local tee_pid=$!
    set +e
    # A background command of a script is not a process-group leader, so setsid execs in place: $! is
    # torchrun itself, started through $tied_to_launcher.
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" setsid "$PYTHON" -c "$tied_to_launcher" $$ \
        -m torch.distributed.run "${args[@]}" "${entry[@]}" "$@" > "$fifo_dir/out" 2>&1 &
    pid=$!
    while :; do
        wait "$pid"
        rc=$?
        kill -0 "$pid" 2> /dev/null || break  # wait was cut short by a trapped signal: keep waiting
    done
    wait "$tee_pid"
    set -e
}

saved_checkpoint() {
    sed -n 's/.*megatron-rl: received SIG[A-Z0-9]* at step [0-9]*; saved \([^;]*\);.*/\1/p' "$LOG" | tail -n 1
}

explain() {
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron_rl.run.launch_checks explain-log "$LOG" \
        --node "$NODE_RANK" --rc "$rc" 2>&1 | tee -a "$LOG" >&2
}

run_torchrun "$@"
restarts=0
while [[ "$rc" != 0 ]]; do
    if [[ "$stop_sig" == USR1 ]]; then
        echo "megatron-rl: node $NODE_RANK re-placing: starting torchrun again (resumes from $(saved_checkpoint))" \
            | tee -a "$LOG" >&2
        pid="" stop_sig=""
        MEGATRON_RL_REPLACED=1 run_torchrun "$@"
    elif [[ -z "$stop_sig" && "$restarts" -lt "$MAX_RESTARTS" ]]; then
        # A new torchrun, not torchrun's own restart: its rendezvous store starts empty (torchrun's
        # restarts reuse the store, where the last attempt's process-group addresses still sit).
        explain
        restarts=$((restarts + 1))
        echo "megatron-rl: node $NODE_RANK restarting torchrun ($restarts of --max-restarts $MAX_RESTARTS):" \
             "the ranks resume from the newest checkpoint" | tee -a "$LOG" >&2
        pid=""
        run_torchrun "$@"
    else
        break
    fi
done
if [[ -n "$stop_sig" && "$rc" != 0 ]]; then
    saved="$(saved_checkpoint)"
    echo "megatron-rl: node $NODE_RANK stopped by SIG$stop_sig (torchrun exit $rc):" \
         "${saved:+checkpoint $saved; }resume with the same command" | tee -a "$LOG" >&2
    exit $((128 + $(kill -l "$stop_sig")))
fi
if [[ "$rc" != 0 ]]; then
    explain
fi
exit "$rc"
