"""NVIDIA GPUs through NVML (PyPI ``nvidia-ml-py``, imported as ``pynvml`` only when this backend opens).

* energy: ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver load; Volta and newer). When any selected GPU
  lacks it (NVMLError), the backend reports no counter and the monitor integrates sampled power instead.
* power: ``nvmlDeviceGetPowerUsage`` (mW).
* cap: ``nvmlDeviceGetEnforcedPowerLimit`` (mW) — the limit actually enforced, i.e. the configured power cap.
"""
from __future__ import annotations

from tokenfab.power.gpu_library import GpuLibraryBackend


class NvmlBackend(GpuLibraryBackend):
    """NVML reader for the GPUs ``indices`` (physical NVML indices; default: CUDA_VISIBLE_DEVICES or all)."""

    name = "nvml"
    cap_source = "NVML enforced power limit"
    module, label, visible_env = "pynvml", "NVML", "CUDA_VISIBLE_DEVICES"
    install_hint = "install nvidia-ml-py"
    energy_units_per_j = 1000.0  # mJ

    def _init(self, nv) -> None:
        nv.nvmlInit()

    def _shutdown(self, nv) -> None:
        nv.nvmlShutdown()

    def _handles_of(self, nv, indices):
        return int(nv.nvmlDeviceGetCount()), nv.nvmlDeviceGetHandleByIndex

    def _energy_raw(self, h) -> float:
        """nvmlDeviceGetTotalEnergyConsumption: mJ since the driver loaded (Volta and newer)."""
        return float(self._lib.nvmlDeviceGetTotalEnergyConsumption(h))

    def _power_w(self, h) -> float:
        """nvmlDeviceGetPowerUsage: mW / 1000."""
        return float(self._lib.nvmlDeviceGetPowerUsage(h)) / 1000.0

    def _cap_w(self, h) -> float:
        """nvmlDeviceGetEnforcedPowerLimit: mW / 1000."""
        return float(self._lib.nvmlDeviceGetEnforcedPowerLimit(h)) / 1000.0
