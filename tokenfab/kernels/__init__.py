"""Fused kernels for the hot path: ``cpu_kernels`` (C++ built on first use, PyTorch fallback)."""
