#!/usr/bin/env bash
# make test-slurm: proves launch/slurm.sbatch on a real Slurm. Installs Debian's Slurm and MUNGE if
# missing, starts a private one-node cluster on loopback (munged, slurmctld, slurmd, all with their
# config, sockets, state and logs in one temporary directory and on free ports, so an existing Slurm or
# MUNGE on the machine is left alone), submits slurm.sbatch running the CPU demo config for a few PPO
# steps (1 node, 1 task, torchrun with 2 processes at TP=2), waits, and checks that the job COMPLETED
# with exit code 0 and that the trainer wrote its metrics; then submits a job that cannot run (one
# process for TP=2) and checks that it FAILED with a non-zero exit code and a one-line reason; then
# stops a running job with SIGUSR2 to its batch shell (what --signal=B:USR2@300 sends before the time
# limit) and checks that it saved the step, requeued itself, resumed from that checkpoint and COMPLETED.
# The daemons it started are stopped (by PID) and the temporary directory removed on every exit path.
#
#   bash launch/test_slurm.sh            knobs: STEPS=2  TIMEOUT_S=900  KEEP_TMP=1 (keep logs)  PYTHON=...
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
STEPS="${STEPS:-2}"
TIMEOUT_S="${TIMEOUT_S:-900}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3
t_start=$SECONDS
say() { echo "[test-slurm $((SECONDS - t_start))s] $*"; }
fail() { echo "[test-slurm] FAIL: $*" >&2; exit 1; }

# ---- 1. packages ---------------------------------------------------------------------------------------
if ! command -v slurmctld > /dev/null || ! command -v slurmd > /dev/null || ! command -v sbatch > /dev/null \
    || ! command -v munged > /dev/null; then
    [[ "$(id -u)" == 0 ]] || fail "Slurm is not installed and installing it needs root (apt-get)."
    say "installing slurmctld slurmd slurm-client munge (apt-get)"
    # Keep the packages' init scripts from starting system daemons: this test runs its own.
    made_policy=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge > /dev/null
    [[ -z "$made_policy" ]] || rm -f /usr/sbin/policy-rc.d
fi

# ---- 2. private cluster directory and cleanup ------------------------------------------------------------
TMP="$(mktemp -d /tmp/megatron-rl-slurm.XXXXXX)"
chmod 700 "$TMP"
PIDS=()      # daemons this script started, newest last
JOB_ID=""
cleanup() {
    local rc=$?
    set +e
    if [[ -n "$JOB_ID" ]] && [[ -n "$(squeue -h -j "$JOB_ID" 2> /dev/null)" ]]; then
        scancel "$JOB_ID"
        for _ in $(seq 30); do [[ -z "$(squeue -h -j "$JOB_ID" 2> /dev/null)" ]] && break; sleep 1; done
    fi
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        kill "${PIDS[i]}" 2> /dev/null
        for _ in $(seq 50); do kill -0 "${PIDS[i]}" 2> /dev/null || break; sleep 0.2; done
        kill -9 "${PIDS[i]}" 2> /dev/null
        wait "${PIDS[i]}" 2> /dev/null
    done
    if [[ "$rc" != 0 ]]; then
        echo "---- daemon and job logs ($TMP) ----" >&2
        tail -n 30 "$TMP"/*.log "$TMP"/job-*.out "$TMP"/logs/node*.log 2> /dev/null >&2
    fi
    if [[ -n "${KEEP_TMP:-}" ]]; then echo "[test-slurm] kept $TMP"; else rm -rf "$TMP"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
NODE="$(hostname -s)"
CTLD_PORT="$(free_port)"
SLURMD_PORT="$(free_port)"
while [[ "$SLURMD_PORT" == "$CTLD_PORT" ]]; do SLURMD_PORT="$(free_port)"; done
mkdir -p "$TMP/state" "$TMP/spool"

# ---- 3. MUNGE with a fresh key on a private socket -------------------------------------------------------
head -c 1024 /dev/urandom > "$TMP/munge.key"
chmod 400 "$TMP/munge.key"
munged --foreground --force --key-file="$TMP/munge.key" --socket="$TMP/munge.socket" \
    --pid-file="$TMP/munged.pid" --log-file="$TMP/munged.log" --seed-file="$TMP/munged.seed" \
    > "$TMP/munged.stdout.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do [[ -S "$TMP/munge.socket" ]] && break; sleep 0.1; done
[[ -S "$TMP/munge.socket" ]] || fail "munged did not start (log: $TMP/munged.log)."

# ---- 4. a one-node, 2-CPU cluster on loopback ---------------------------------------------------------------
cat > "$TMP/slurm.conf" << EOF
ClusterName=megatronrltest
SlurmctldHost=${NODE}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${TMP}/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=${TMP}/state
SlurmdSpoolDir=${TMP}/spool
SlurmctldPidFile=${TMP}/slurmctld.pid
SlurmdPidFile=${TMP}/slurmd.pid
SlurmctldLogFile=${TMP}/slurmctld.log
SlurmdLogFile=${TMP}/slurmd.log
# no cgroups in a container: track processes by parent PID, no task binding, no accounting daemon
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=${TMP}/jobcomp.txt
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1024 State=UNKNOWN
PartitionName=test Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$TMP/slurm.conf"

say "starting slurmctld (port $CTLD_PORT) and slurmd (port $SLURMD_PORT) for node $NODE"
slurmctld -D -i -f "$SLURM_CONF" > "$TMP/slurmctld.stdout.log" 2>&1 &
PIDS+=($!)
slurmd -D -f "$SLURM_CONF" -N "$NODE" > "$TMP/slurmd.stdout.log" 2>&1 &
PIDS+=($!)
state=""
for _ in $(seq 120); do
    state="$(sinfo -h -n "$NODE" -o %T 2> /dev/null || true)"
    [[ "$state" == idle ]] && break
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2> /dev/null || fail "a Slurm daemon exited (logs: $TMP)."; done
    sleep 0.5
done
[[ "$state" == idle ]] || fail "node $NODE did not become idle (state: '${state:-none}')."
say "cluster up: $(sinfo -h -o '%P %D %c %T')"

# Waits for job $1, then sets job_state, exit_code (from scontrol) and comp (the job completion record).
wait_job() {
    say "job $1 submitted; waiting (at most ${TIMEOUT_S}s)"
    local deadline=$((SECONDS + TIMEOUT_S)) job
    while [[ -n "$(squeue -h -j "$1" 2> /dev/null)" ]]; do
        ((SECONDS < deadline)) || fail "job $1 still running after ${TIMEOUT_S}s."
        sleep 1
    done
    job="$(scontrol show job "$1" 2> /dev/null || true)"
    job_state="$(grep -o 'JobState=[A-Z_]*' <<< "$job" | cut -d= -f2)"
    exit_code="$(grep -o ' ExitCode=[0-9:]*' <<< "$job" | cut -d= -f2)"
    comp="$(grep "JobId=$1 " "$TMP/jobcomp.txt" 2> /dev/null || true)"
    say "job $1: JobState=$job_state ExitCode=$exit_code; completion record: ${comp:0:120}..."
}

# ---- 5. the job: CPU demo, a few PPO steps, through launch/slurm.sbatch ----------------------------------------
say "preparing the CPU demo data and model"
"$PYTHON" -m megatron_rl.demo --out "$TMP/demo" > /dev/null
RUN_DIR="$TMP/run"
say "submitting launch/slurm.sbatch (CPU demo, $STEPS steps, 2 processes, TP=2)"
JOB_ID="$(PYTHON="$PYTHON" LOG_DIR="$TMP/logs" sbatch --parsable --nodes=1 --exclusive \
    --output="$TMP/job-%j.out" --chdir="$REPO" launch/slurm.sbatch --nproc 2 \
    --config yaml/cpu_demo.yaml trainer.total_training_steps="$STEPS" trainer.val_before_train=false \
    "data.train_files=[$TMP/demo/data/train.parquet]" "data.val_files=[$TMP/demo/data/test.parquet]" \
    actor_rollout_ref.model.path="$TMP/demo/model" trainer.default_local_dir="$RUN_DIR" \
    trainer.save_at_end=false)"
JOB_ID="${JOB_ID%%;*}"
wait_job "$JOB_ID"

# ---- 6. checks ---------------------------------------------------------------------------------------------
[[ "$job_state" == COMPLETED && "$exit_code" == 0:0 ]] \
    || fail "job $JOB_ID ended $job_state with exit code $exit_code (output: $TMP/job-$JOB_ID.out)."
grep -q "JobState=COMPLETED" <<< "$comp" || fail "no COMPLETED record for job $JOB_ID in $TMP/jobcomp.txt."
[[ -s "$TMP/logs/node0.log" ]] || fail "no per-node log $TMP/logs/node0.log."
metrics="$RUN_DIR/logs/metrics.jsonl"
[[ -s "$metrics" ]] || fail "the job wrote no metrics ($metrics missing)."
"$PYTHON" - "$metrics" "$STEPS" << 'EOF' || fail "metrics check failed."
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = sorted({r["step"] for r in rows if "actor/pg_loss" in r})
want = list(range(1, int(sys.argv[2]) + 1))
assert steps == want, f"training steps logged {steps}, expected {want}"
for r in rows:
    for k in ("actor/pg_loss", "critic/vf_loss"):
        assert k not in r or math.isfinite(r[k]), f"step {r['step']}: {k}={r[k]}"
print(f"metrics: {len(rows)} rows, steps {steps}, keys e.g. {sorted(rows[-1])[:4]}")
EOF
grep -q "megatron-rl: job $JOB_ID succeeded." "$TMP/job-$JOB_ID.out" || fail "the job's output lacks its success line."
GOOD_JOB="$JOB_ID"
say "job $JOB_ID: $(grep -c . "$metrics") metrics rows in $metrics"

# ---- 7. a job that cannot run: non-zero exit and one line saying why ---------------------------------------
say "submitting a job that cannot run: 1 process for TP=2"
JOB_ID="$(PYTHON="$PYTHON" LOG_DIR="$TMP/logs-bad" sbatch --parsable --nodes=1 --exclusive \
    --output="$TMP/job-%j.out" --chdir="$REPO" launch/slurm.sbatch --nproc 1 \
    --config yaml/cpu_demo.yaml actor_rollout_ref.model.path="$TMP/demo/model")"
JOB_ID="${JOB_ID%%;*}"
wait_job "$JOB_ID"
[[ "$job_state" == FAILED && "$exit_code" != 0:0 ]] \
    || fail "the bad job ended $job_state with exit code $exit_code; expected FAILED, non-zero."
why="$(grep -h "megatron-rl: node 0 failed" "$TMP/job-$JOB_ID.out" | head -n 1)"
say "its reason: $why"
[[ "$why" == *"world size 1"* || "$why" == *"World size 1"* ]] || fail "no one-line reason in $TMP/job-$JOB_ID.out."

BAD_JOB="$JOB_ID"

# ---- 8. preemption: the time-limit warning stops the job after a saved step; it requeues and resumes --------
# scancel --signal=USR2 --batch sends what #SBATCH --signal=B:USR2@300 sends before the time limit.
PRE_STEPS="${PRE_STEPS:-40}"
PRE_DIR="$TMP/run-preempt"
say "submitting a $PRE_STEPS-step job; SIGUSR2 to its batch shell after step 2"
JOB_ID="$(PYTHON="$PYTHON" LOG_DIR="$TMP/logs-preempt" sbatch --parsable --nodes=1 --exclusive \
    --output="$TMP/job-%j.out" --chdir="$REPO" launch/slurm.sbatch --nproc 2 \
    --config yaml/cpu_demo.yaml trainer.total_training_steps="$PRE_STEPS" trainer.val_before_train=false \
    trainer.test_freq=-1 "data.train_files=[$TMP/demo/data/train.parquet]" \
    "data.val_files=[$TMP/demo/data/test.parquet]" actor_rollout_ref.model.path="$TMP/demo/model" \
    trainer.default_local_dir="$PRE_DIR" trainer.resume_mode=auto "trainer.logger=[console,jsonl]" \
    data.train_batch_size=16 actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 critic.ppo_micro_batch_size_per_gpu=32)"
JOB_ID="${JOB_ID%%;*}"
pre_metrics="$PRE_DIR/logs/metrics.jsonl"
deadline=$((SECONDS + TIMEOUT_S))
until grep -q '"step": 2,' "$pre_metrics" 2> /dev/null; do
    ((SECONDS < deadline)) || fail "job $JOB_ID logged no step 2 within ${TIMEOUT_S}s."
    [[ -n "$(squeue -h -j "$JOB_ID" 2> /dev/null)" ]] || fail "job $JOB_ID ended before step 2."
    sleep 0.5
done
scancel --signal=USR2 --batch "$JOB_ID"
until grep -q "megatron-rl: job $JOB_ID stopped by SIGUSR2" "$TMP/job-$JOB_ID.out" 2> /dev/null; do
    ((SECONDS < deadline)) || fail "job $JOB_ID did not stop on SIGUSR2 within ${TIMEOUT_S}s."
    sleep 0.5
done
say "$(grep -h "megatron-rl: job $JOB_ID stopped by SIGUSR2" "$TMP/job-$JOB_ID.out")"
# Slurm holds a requeued batch job back until the old run's credential expires (cred_expire, 10 s here).
wait_job "$JOB_ID"
out="$TMP/job-$JOB_ID.out"
[[ "$job_state" == COMPLETED && "$exit_code" == 0:0 ]] \
    || fail "the preempted job ended $job_state with exit code $exit_code after its requeue (output: $out)."
stopped="$(grep -ho "megatron-rl: received SIGUSR2 at step [0-9]*; saved [^;]*" "$out" | head -n 1)"
[[ -n "$stopped" ]] || fail "no 'received SIGUSR2 at step N; saved <path>' line in $out."
step="$(sed 's/.* at step \([0-9]*\);.*/\1/' <<< "$stopped")"
grep -q "requeued: it resumes from the latest checkpoint" "$out" || fail "the job did not requeue itself ($out)."
grep -q "resumed from $PRE_DIR/global_step_$step at step $step" "$out" \
    || fail "the restarted job did not resume from global_step_$step ($out)."
"$PYTHON" - "$pre_metrics" "$PRE_STEPS" << 'EOF' || fail "preemption metrics check failed."
import json, sys
steps = [json.loads(line)["step"] for line in open(sys.argv[1]) if line.strip()]
want = list(range(1, int(sys.argv[2]) + 1))
assert steps == want, f"steps logged across the stop and the restart: {steps}, expected each of {want} once"
EOF
say "job $JOB_ID: stopped at step $step by SIGUSR2, saved, requeued, resumed, COMPLETED"

say "PASS: slurm.sbatch ran $STEPS PPO steps (job $GOOD_JOB: COMPLETED, exit 0, metrics written), a" \
    "job that cannot run failed with a non-zero exit and a one-line reason (job $BAD_JOB), and a job" \
    "stopped by SIGUSR2 saved step $step, requeued itself and finished from there (job $JOB_ID)"
