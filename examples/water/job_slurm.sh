#!/bin/bash
# Multi-node training on the water example with Slurm + torchrun (one torchrun agent per node).
#
#   cd /path/to/mdloader && mkdir -p logs && sbatch examples/water/job_slurm.sh
#   sbatch examples/water/job_slurm.sh --restart runs/water-<jobid>/model.ckpt.pt   # continue
#
# Arguments after the script name go to `mdloader train` (e.g. --numb-steps 5000).
# Logs: Slurm writes every process's stdout/stderr to logs/<job name>-<job id>.out (--output
# below); mdloader's rank-0 log also goes to $RUN_DIR/train.log, lcurve.out and checkpoints to
# $RUN_DIR; torchrun keeps one stdout/stderr file per rank under $RUN_DIR/torchrun/.
# Time limit: 120 s before it, the job stops after a step with a checkpoint and requeues itself;
# the requeued job (same job id, same $RUN_DIR) continues from that checkpoint.
#
#SBATCH --job-name=mdloader-water
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node; torchrun starts the ranks
#SBATCH --gpus-per-node=4            # one rank per GPU
#SBATCH --cpus-per-task=32           # all the node's cores for its ranks and their workers
#SBATCH --time=01:00:00
#SBATCH --output=logs/%x-%j.out      # the folder must exist before sbatch
#SBATCH --signal=B:USR1@120          # SIGUSR1 to this script 120 s before the time limit
#SBATCH --requeue                    # let the script requeue the job (see the end)
set -euo pipefail

# --- topology: ranks per node = GPUs per node (set NPROC_PER_NODE on CPU-only nodes) -----------
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-4}}
CPUS=${SLURM_CPUS_PER_TASK:-$(nproc)}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}
RUN_DIR=${RUN_DIR:-runs/water-$SLURM_JOB_ID}   # a requeued job keeps its id, hence its folder
mkdir -p "$RUN_DIR"
RESTART=()                                     # after a requeue: continue from the checkpoint
if [[ -e "$RUN_DIR/model.ckpt.pt" ]]; then
  RESTART=(--restart "$RUN_DIR/model.ckpt.pt")
fi

# --- mdloader (read by the loader on every rank; see docs/hpc.md) -------------------------------
# Threads with which rank 0 reads the headers of every system (default 8). On a shared file
# system each open is a network round trip: more threads overlap more of them.
export MDLOADER_BUILD_WORKERS=${MDLOADER_BUILD_WORKERS:-16}
# Seconds the other ranks wait for rank 0's build before failing with a clear error (default 1800).
export MDLOADER_BUILD_TIMEOUT=${MDLOADER_BUILD_TIMEOUT:-3600}
# Memory maps (= open files) one process keeps (default: soft `ulimit -n` / 16, at most 1024);
# per rank *and* per worker.
export MDLOADER_MAX_OPEN_FILES=${MDLOADER_MAX_OPEN_FILES:-1024}
# DataLoader worker processes per rank (as in DeePMD-kit; default min(4, cpus)).
export NUM_WORKERS=${NUM_WORKERS:-4}

# --- torch ----------------------------------------------------------------------------------------
# Intra-op threads per rank: the node's cores shared by its ranks and their workers.
PER_RANK=$(( CPUS / NPROC_PER_NODE / (NUM_WORKERS + 1) ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( PER_RANK > 0 ? PER_RANK : 1 ))}

echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) x $NPROC_PER_NODE rank(s), rendezvous" \
     "$HEAD_NODE:$RDZV_PORT, OMP_NUM_THREADS=$OMP_NUM_THREADS, NUM_WORKERS=$NUM_WORKERS," \
     "output in $RUN_DIR"

# At the signal, pass SIGTERM on: srun forwards it to torchrun, torchrun to every rank, and the
# ranks stop after the same step, write a checkpoint and exit with 143 (torchrun waits 30 s for
# that, its --shutdown-timeout). Then the job goes back to the queue. torchrun itself exits with 1
# and a SignalException traceback whenever it is signalled, whatever its ranks did: after a stop
# this script reports the checkpoint and exits with the ranks' 143 instead.
STOPPED=""
trap 'STOPPED=1; kill -TERM "$SRUN_PID" 2>/dev/null || true' USR1

# c10d rendezvous: every node's torchrun meets at the head node; no static node ranks needed.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  torchrun --nnodes="$SLURM_NNODES" --nproc-per-node="$NPROC_PER_NODE" \
           --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d \
           --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" \
           --log-dir="$RUN_DIR/torchrun" --tee=3 \
  -m mdloader train examples/water/input.json --output "$RUN_DIR" \
           --log-path "$RUN_DIR/train.log" ${RESTART[@]+"${RESTART[@]}"} "$@" &
SRUN_PID=$!
rc=0
wait "$SRUN_PID" || rc=$?
if [[ -n "$STOPPED" ]]; then   # the wait above returned at the signal: wait for the checkpoint
  wait "$SRUN_PID" || true     # torchrun's own 1 (SignalException): the ranks' codes are 143
  latest=$(cat "$RUN_DIR/checkpoint" 2>/dev/null || echo "none yet")
  echo "stopped before the time limit, latest checkpoint: $latest; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  rc=143
fi
exit "$rc"
