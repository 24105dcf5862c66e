# Sourced by the DMD2 demos on FLUX.1 Kontext and Qwen-Image-Edit: train_students OUT NPROC ARGS...
# distils the 4-step (σ 1, .75, .5, .25: the export's 4 inference steps) and the 1-step student (pure
# noise in at σ 1, x0 out) with train_dmd.py on NPROC ranks into OUT/4step and OUT/1step. Each run's
# arguments: the caller's COMMON array, then its FOUR_STEP_ARGS or ONE_STEP_ARGS array (if set), then
# ARGS (the later override the earlier). With a ONE_STEP_STAGE1_ARGS array, the 1-step student trains in
# two stages: OUT/1step_stage1 with those arguments added (before ARGS), then OUT/1step from its final
# checkpoint (INIT_FROM) without them. With FOUR_STEP_FROM_ONE_STEP=1 the 1-step student trains first
# and the 4-step one starts from its final checkpoint (FOUR_STEP_FROM=1step_stage1: from its first stage's).
# Appends each run's wall time to `times`.
train_students() {
    local out=$1 nproc=$2 run
    local -a own init runs=(4step 1step)
    shift 2
    if [ "${FOUR_STEP_FROM_ONE_STEP:-0}" = 1 ]; then runs=(1step 4step); fi
    for run in "${runs[@]}"; do
        init=()
        if [ "$run" = 4step ]; then
            own=(--denoising_steps=999,749,499,249 ${FOUR_STEP_ARGS[@]+"${FOUR_STEP_ARGS[@]}"})
            if [ "${FOUR_STEP_FROM_ONE_STEP:-0}" = 1 ]; then
                init=(--init_from="$(newest_checkpoint "$out/${FOUR_STEP_FROM:-1step}")")
            fi
        else
            own=(--denoising_steps= ${ONE_STEP_ARGS[@]+"${ONE_STEP_ARGS[@]}"})
            if [ -n "${ONE_STEP_STAGE1_ARGS[*]+set}" ]; then
                student_run "$out" "$nproc" 1step_stage1 "${own[@]}" "${ONE_STEP_STAGE1_ARGS[@]}" "$@"
                init=(--init_from="$(newest_checkpoint "$out/1step_stage1")")
            fi
        fi
        student_run "$out" "$nproc" "$run" "${own[@]}" "${init[@]+"${init[@]}"}" "$@"
    done
}

# student_run OUT NPROC NAME ARGS...: one train_dmd.py run into OUT/NAME, COMMON then ARGS; its wall time
# appended to `times`. A run whose export exists is kept (an interrupted demo goes on where it stopped).
student_run() {
    local out=$1 nproc=$2 name=$3 start
    shift 3
    if [ -f "$out/$name/export/model_index.json" ]; then
        echo "$out/$name: exported already, kept"
        return
    fi
    start=$(date +%s)
    python -m torch.distributed.run --standalone --nproc_per_node="$nproc" train_dmd.py "${COMMON[@]}" \
        --output_dir="$out/$name" "$@"
    times+=("$name $(( $(date +%s) - start )) s")
}

# newest_checkpoint RUN_DIR: the checkpoint a run wrote at its last step
newest_checkpoint() {
    ls -d "$1/checkpoints/step_"* | sort | tail -n 1
}
