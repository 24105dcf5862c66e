"""The Z-Image family (ZImagePipeline: Z-Image base, text to image; ZImageOmniPipeline: edits from references,
omni.py) as one package: room.py, what train_dmd.py asks of it, whose names this package exposes
(`from families import z_image; z_image.dmd_cond(...)`).
"""
from families.z_image.room import *  # noqa: F401,F403 - the room's names, the package's interface
