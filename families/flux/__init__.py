"""The FLUX.1 family (Kontext, text-to-image) as one package: room.py, what the scripts ask of it, whose names
this package exposes (`from families import flux; flux.build_transformer(...)`).
"""
from families.flux.room import *  # noqa: F401,F403 - the room's names, the package's interface
