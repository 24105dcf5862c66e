"""The Wan family (WanPipeline: Wan 2.1 and 2.2 text to video; WanImageToVideoPipeline: Wan 2.1 image to video) as
one package: room.py, what train_dmd.py asks of it, whose names this package exposes (`from families import wan;
wan.pack_latents(...)`).
"""
from families.wan.room import *  # noqa: F401,F403 - the room's names, the package's interface
from families.wan.room import _mean_inv_std  # noqa: F401
