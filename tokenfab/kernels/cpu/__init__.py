"""tokenfab's CPU kernels: C++ sources (csrc/), their build (build.py), the Python wrappers (ops.py) and the
instruction-set setting (isa.py, torch-free: ``tokenfab`` imports it at import time)."""
