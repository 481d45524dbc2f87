"""tokenfab's GPU kernels (Triton): support.py says whether they run; one file per kernel family."""
