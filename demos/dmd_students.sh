# Sourced by the DMD2 demos on FLUX.1 Kontext and Qwen-Image-Edit: train_students OUT NPROC ARGS...
# distils the 4-step (σ 1, .75, .5, .25: the export's 4 inference steps) and the 1-step student (pure
# noise in at σ 1, x0 out) with train_dmd.py on NPROC ranks into OUT/4step and OUT/1step; ARGS go to
# both runs, last (so they override). Appends each run's wall time to the caller's `times` array.
train_students() {
    local out=$1 nproc=$2 run steps start
    shift 2
    for run in 4step 1step; do
        steps=--denoising_steps=999,749,499,249
        [ "$run" = 1step ] && steps=--denoising_steps=
        start=$(date +%s)
        python -m torch.distributed.run --standalone --nproc_per_node="$nproc" train_dmd.py "$steps" \
            --output_dir="$out/$run" "$@"
        times+=("$run $(( $(date +%s) - start )) s")
    done
}
