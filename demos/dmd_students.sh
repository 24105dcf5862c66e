# Sourced by the DMD2 demos on FLUX.1 Kontext and Qwen-Image-Edit: train_students OUT NPROC ARGS...
# distils the 4-step (σ 1, .75, .5, .25: the export's 4 inference steps) and the 1-step student (pure
# noise in at σ 1, x0 out) with train_dmd.py on NPROC ranks into OUT/4step and OUT/1step. Each run's
# arguments: the caller's COMMON array, then its FOUR_STEP_ARGS or ONE_STEP_ARGS array (if set), then
# ARGS (the later override the earlier). Appends each run's wall time to the caller's `times` array.
train_students() {
    local out=$1 nproc=$2 run start
    local -a own
    shift 2
    for run in 4step 1step; do
        if [ "$run" = 4step ]; then
            own=(--denoising_steps=999,749,499,249 ${FOUR_STEP_ARGS[@]+"${FOUR_STEP_ARGS[@]}"})
        else
            own=(--denoising_steps= ${ONE_STEP_ARGS[@]+"${ONE_STEP_ARGS[@]}"})
        fi
        start=$(date +%s)
        python -m torch.distributed.run --standalone --nproc_per_node="$nproc" train_dmd.py "${COMMON[@]}" \
            "${own[@]}" --output_dir="$out/$run" "$@"
        times+=("$run $(( $(date +%s) - start )) s")
    done
}
