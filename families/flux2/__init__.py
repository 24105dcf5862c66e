"""The FLUX.2 family ([klein], [dev]) as one package: room.py, what the scripts ask of it, whose names this
package exposes (`from families import flux2; flux2.model_inputs(...)`).
"""
from families.flux2.room import *  # noqa: F401,F403 - the room's names, the package's interface
from families.flux2.room import _bn_stats, _patchify, _unpatchify, _unwrapped  # noqa: F401
