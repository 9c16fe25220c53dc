"""GPT-J training, sampling, serving and checkpoint interchange on today's JAX.

Importing the package makes a machine without an accelerator a CPU machine before JAX starts, whatever JAX plugins
are installed (`platforms.pin_platform`).
"""
from mesh_transformer import platforms as _platforms

_platforms.pin_platform()
