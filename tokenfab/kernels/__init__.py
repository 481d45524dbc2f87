"""Kernels, a room per device: ``cpu/`` (C++ sources, their build, the Python wrappers, the ISA setting) and ``gpu/``
(Triton). Layers reach them through :mod:`tokenfab.kernels.dispatch`, one seam per op family."""
