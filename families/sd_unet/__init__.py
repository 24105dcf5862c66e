"""The SD UNet family (SD-1.5, SDXL) as one package: room.py, what the scripts ask of it, whose names this
package exposes (`from families import sd_unet; sd_unet.build_unet(...)`).
"""
from families.sd_unet.room import *  # noqa: F401,F403 - the room's names, the package's interface
from families.sd_unet.room import _EDIT_SETTINGS, _REAL_ORDER_SALT, _nhwc_input  # noqa: F401
