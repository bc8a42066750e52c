#!/usr/bin/env bash
# GPU validation on 2 GPUs: kernel tests, training runs and the cp=2 vs cp=1 comparison.
# Results (logs, a summary table and JSON) go to $RESULTS (default ./outputs/gpu_validation).
#
#   scripts/gpu_validation.sh all              # everything below, in order
#   scripts/gpu_validation.sh seed cp2 summary # single steps: gpu_tests seed cp1 cp2 fsdp debug
#                                              #   eager16k compiled16k long08b long2b (GPU=<index>)
#   FLAVOR=2B scripts/gpu_validation.sh seed scaling summary  # 8 GPUs: cp 1, 2, 4, 8; dp 2 x cp 4
#   CACHE_ARCHIVE=dir scripts/gpu_validation.sh restore_caches ... save_caches
# The seed checkpoint is deterministic (CPU init from debug.seed), so runs made on different
# machines from their own seed start from the same weights.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-./outputs/gpu_validation}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 LOG_RANK=0
# Compile caches: Triton kernels with their autotuning choices, Inductor graphs. A fresh machine
# spends minutes per process rebuilding them; `save_caches` packs them into $CACHE_ARCHIVE (15 MB
# parts) after a run, `restore_caches` unpacks them first thing on the next machine of the same
# kind (same GPU, driver and image).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}
CACHE_ARCHIVE=${CACHE_ARCHIVE:-./outputs/compile_caches}

SEQ_CP=${SEQ_CP:-32768}
STEPS_CP=${STEPS_CP:-50}
FLAVOR=${FLAVOR:-0.8B}
BIG=(--model.flavor "$FLAVOR" --training.local_batch_size 1 --training.mixed_precision_param bfloat16
     --activation_checkpoint.mode full --optimizer.lr 3e-4 --lr_scheduler.warmup_steps 5
     --metrics.log_freq 1)
SEED_DIR="$RESULTS/seed_$FLAVOR"

train() {  # train NAME NGPU [overrides...]
    local name=$1 ngpu=$2; shift 2
    NGPU=$ngpu ./run_train.sh --job.dump_folder "$RESULTS/$name" "$@" >"$RESULTS/$name.log" 2>&1
    echo "$name: exit $?"
}

seed() {
    CUDA_VISIBLE_DEVICES=0 train "seed_$FLAVOR" 1 "${BIG[@]}" --training.seq_len "$SEQ_CP" \
        --checkpoint.enable --checkpoint.create_seed_checkpoint
}

gpu_tests() {
    CUDA_VISIBLE_DEVICES=${TEST_GPU:-0} python -m pytest -m gpu tests/gpu -n 4 --dist loadfile \
        -q --tb=short --durations=0 -p no:cacheprovider >"$RESULTS/gpu_tests.log" 2>&1
    echo "gpu tests: exit $?"
}

# The same run from the seed on CP x DP GPUs (one row per dp rank): its name says the layout.
cp_run() {  # cp_run CP DP
    local name="cp$1_seq$((SEQ_CP / 1024))k"
    [ "$2" = 1 ] || name="${name}_dp$2"
    [ "$FLAVOR" = 0.8B ] || name="${FLAVOR}_$name"
    train "$name" $(($1 * $2)) "${BIG[@]}" --training.seq_len "$SEQ_CP" \
        --training.steps "$STEPS_CP" --parallelism.context_parallel_degree "$1" \
        --parallelism.data_parallel_shard_degree "$2" \
        --checkpoint.initial_load_path "$SEED_DIR/checkpoint/step-0" --checkpoint.enable \
        --checkpoint.interval 100000
}

cp1() { CUDA_VISIBLE_DEVICES=0 cp_run 1 1; }
cp2() { cp_run 2 1; }

# On 8 GPUs: loss curves at cp 2, 4, 8 against cp=1, and dp_shard 2 x cp 4 against
# dp_shard 2 (two rows a step); `summary` compares each with its baseline.
scaling() {
    cp_run 1 1; cp_run 2 1; cp_run 4 1; cp_run 8 1
    cp_run 1 2; cp_run 4 2
}

fsdp() {
    train fsdp2_seq8k 2 "${BIG[@]}" --training.seq_len 8192 --training.steps 25
}

# Eager against compiled (inductor): the same 0.8B run at 16k from the same seed.
SEQ_COMPILE=${SEQ_COMPILE:-16384}
STEPS_COMPILE=${STEPS_COMPILE:-15}
eager16k() {
    CUDA_VISIBLE_DEVICES=${GPU:-0} train eager_seq16k 1 "${BIG[@]}" --training.seq_len "$SEQ_COMPILE" \
        --training.steps "$STEPS_COMPILE" --debug.seed 42
}

compiled16k() {
    CUDA_VISIBLE_DEVICES=${GPU:-0} train compiled_seq16k 1 "${BIG[@]}" --training.seq_len "$SEQ_COMPILE" \
        --training.steps "$STEPS_COMPILE" --debug.seed 42 --compile.enable
}

# Long rows on one GPU, compiled, full AC, chunked loss: 0.8B at 256k, 2B at 128k.
long08b() {
    CUDA_VISIBLE_DEVICES=${GPU:-0} train long_0.8b_seq256k 1 "${BIG[@]}" --training.seq_len 262144 \
        --training.steps 6 --compile.enable
}

long2b() {
    CUDA_VISIBLE_DEVICES=${GPU:-0} train long_2b_seq128k 1 "${BIG[@]}" --model.flavor 2B \
        --training.seq_len 131072 --training.steps 6 --compile.enable
}

debug() {
    train debug_2gpu 2 --training.steps 30 --metrics.log_freq 5
}

all() {  # tests on GPU 1 while GPU 0 makes the seed, then the training runs
    TEST_GPU=1 gpu_tests & seed; wait
    cp1; cp2; fsdp; debug
}

save_caches() {
    mkdir -p "$CACHE_ARCHIVE" && rm -f "$CACHE_ARCHIVE"/compile_caches.tgz.part-*
    tar -czf - -C / "${TRITON_CACHE_DIR#/}" "${TORCHINDUCTOR_CACHE_DIR#/}" 2>/dev/null |
        split -b 15M - "$CACHE_ARCHIVE/compile_caches.tgz.part-"
    du -sh "$CACHE_ARCHIVE"
}

restore_caches() {
    cat "$CACHE_ARCHIVE"/compile_caches.tgz.part-* | tar -xzf - -C / && echo "caches restored"
}

summary() {
    grep -E "^(conv|attention|model|fla|torch) |passed|failed" "$RESULTS/gpu_tests.log" | tail -12
    python scripts/summarize_runs.py $(ls "$RESULTS"/{debug_2gpu,fsdp2_seq8k,long_*}.log 2>/dev/null)
    cp_summary
    if [ -f "$RESULTS/compiled_seq16k.log" ]; then
        python scripts/summarize_runs.py "$RESULTS"/{eager_seq16k,compiled_seq16k}.log \
            --compare "$RESULTS/compiled_seq16k.log" "$RESULTS/eager_seq16k.log" \
            --json "$RESULTS/compile_summary.json"
    fi
}

# Every cp run of a flavor and length against the cp=1 run with the same dp degree.
cp_summary() {
    local logs=() compare=() log base
    for log in "$RESULTS"/*cp*_seq*k*.log; do
        [ -f "$log" ] || continue
        logs+=("$log")
        base=$(echo "$log" | sed -E 's/cp[0-9]+_seq/cp1_seq/')
        [ "$log" != "$base" ] && [ -f "$base" ] && compare+=(--compare "$log" "$base")
    done
    [ ${#compare[@]} -gt 0 ] || return 0
    python scripts/summarize_runs.py "${logs[@]}" "${compare[@]}" --json "$RESULTS/summary.json"
}

for step in "${@:-summary}"; do "$step"; done
