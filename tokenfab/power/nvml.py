"""NVIDIA GPUs through NVML (PyPI ``nvidia-ml-py``, imported as ``pynvml`` only when this backend opens).

* energy: ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since driver load; Volta and newer). When any selected GPU
  lacks it (NVMLError), the backend reports no counter and the monitor integrates sampled power instead.
* power: ``nvmlDeviceGetPowerUsage`` (mW).
* cap: ``nvmlDeviceGetEnforcedPowerLimit`` (mW) — the limit actually enforced, i.e. the configured power cap.
"""
from __future__ import annotations

import importlib

from tokenfab.power.base import PowerBackend, PowerBackendError, check_indices, visible_gpu_indices


class NvmlBackend(PowerBackend):
    """NVML reader for the GPUs ``indices`` (physical NVML indices; default: CUDA_VISIBLE_DEVICES or all)."""

    name = "nvml"
    cap_source = "NVML enforced power limit"

    def __init__(self, indices: list[int] | None = None) -> None:
        super().__init__()
        self.indices = indices
        self._nvml = None
        self._handles: list = []
        self._e0_mj: list[float] = []

    def open(self) -> None:
        """Import pynvml, init NVML, pick devices and probe the energy counter."""
        try:
            nv = importlib.import_module("pynvml")
        except ImportError as e:
            raise PowerBackendError(f"pynvml not importable ({e}); install nvidia-ml-py") from None
        try:
            nv.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise PowerBackendError(f"nvmlInit failed: {e}") from None
        self._nvml = nv
        try:
            count = int(nv.nvmlDeviceGetCount())
            if count == 0:
                raise PowerBackendError("NVML sees no GPU")
            indices = self.indices if self.indices is not None else visible_gpu_indices(count)
            check_indices(indices, count, "NVML")
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in indices]
            self.devices = [f"gpu{i}" for i in indices]
            try:
                self._e0_mj = [float(nv.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles]
                self.has_energy_counter = True
            except Exception:  # NVMLError_NotSupported on pre-Volta / some vGPU
                self.has_energy_counter = False
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Shut NVML down."""
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None

    def caps_w(self) -> list[float | None]:
        """Enforced power limit per GPU in W (mW / 1000)."""
        out: list[float | None] = []
        for h in self._handles:
            try:
                out.append(float(self._nvml.nvmlDeviceGetEnforcedPowerLimit(h)) / 1000.0)
            except Exception:
                out.append(None)
        return out

    def read_energy_j(self) -> list[float] | None:
        """Energy since :meth:`open` per GPU in J: (counter_mJ − counter_mJ at open) / 1000."""
        if not self.has_energy_counter:
            return None
        nv = self._nvml
        return [(float(nv.nvmlDeviceGetTotalEnergyConsumption(h)) - e0) / 1000.0
                for h, e0 in zip(self._handles, self._e0_mj)]

    def read_power_w(self) -> list[float] | None:
        """Power draw per GPU in W (nvmlDeviceGetPowerUsage mW / 1000)."""
        nv = self._nvml
        return [float(nv.nvmlDeviceGetPowerUsage(h)) / 1000.0 for h in self._handles]
