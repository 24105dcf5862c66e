"""What the families' tiny test folders share (each family's own builders are families/<name>/tiny.py, named by
its spec's `tiny`; tools/tiny_models.py builds them once into a cache):

    scenes.py      the coloured-shapes world the synthetic datasets draw (the demos' too)
    tokenizers.py  CLIP's and Qwen2's tiny BPE tokenizers, whole words for the prompts' words
    models.py      the image side, seeding, the CLIP text encoder, quiet logs while saving
    data.py        the synthetic datasets: prompts, prompt + image rows, one- and two-reference edits

Built offline, deterministic from their seeds; the scripts never import these (their embedded defaults are
the trained tiny models in assets/).
"""
