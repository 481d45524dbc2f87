"""tokenfab's CPU kernels: C++ sources (csrc/), their build (build.py), the Python wrappers (ops/, one module per
kernel family) and the instruction-set setting (isa.py, torch-free: ``tokenfab`` imports it at import time)."""
