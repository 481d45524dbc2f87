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

    def _init(self, nv) -> None:
        nv.nvmlInit()

    def _shutdown(self, nv) -> None:
        nv.nvmlShutdown()

    def _handles_of(self, nv, indices):
        return int(nv.nvmlDeviceGetCount()), nv.nvmlDeviceGetHandleByIndex

    def _energy_raw(self, h) -> float:
        """nvmlDeviceGetTotalEnergyConsumption: mJ since the driver loaded (Volta and newer)."""
        return float(self._lib.nvmlDeviceGetTotalEnergyConsumption(h))

    def caps_w(self) -> list[float | None]:
        """Enforced power limit per GPU in W (mW / 1000)."""
        out: list[float | None] = []
        for h in self._handles:
            try:
                out.append(float(self._lib.nvmlDeviceGetEnforcedPowerLimit(h)) / 1000.0)
            except Exception:
                out.append(None)
        return out

    def read_energy_j(self) -> list[float] | None:
        """Energy since :meth:`open` per GPU in J: (counter_mJ − counter_mJ at open) / 1000."""
        if not self.has_energy_counter:
            return None
        return [(self._energy_raw(h) - e0) / 1000.0 for h, e0 in zip(self._handles, self._e0)]

    def read_power_w(self) -> list[float] | None:
        """Power draw per GPU in W (nvmlDeviceGetPowerUsage mW / 1000)."""
        return [float(self._lib.nvmlDeviceGetPowerUsage(h)) / 1000.0 for h in self._handles]
