"""The Qwen-Image-Edit family as one package: room.py, what the scripts ask of it, whose names this package
exposes (`from families import qwen_image; qwen_image.load_processor(...)`).
"""
from families.qwen_image.room import *  # noqa: F401,F403 - the room's names, the package's interface
from families.qwen_image.room import _mean_std, _pair  # noqa: F401
