"""Data for both training scripts, one concern per module:

    randomness.py  per-step and per-sample generators: functions of (SEED, step), the same at any world size
    batches.py     which samples a step uses: the global batch, each rank's and micro-batch's share
    sources.py     .jsonl / .txt / image folders / datasets tables read into rows and checked before any work
    images.py      image checks and sizes (EXIF orientation applied), loading, PNG grids
    references.py  multi-reference edits: each reference's size (the pipeline's rule), batch keys
    prefetch.py    the next step's data, loaded on a background thread while this step runs

Imports go one way: data/ imports core/ and precision.py only; the scripts and components/ import data/.
tests/test_layout.py checks it.
"""
