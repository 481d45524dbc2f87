"""The part NVML and amdsmi share: a vendor library imported when the backend opens, initialised, devices picked by
index (a visibility variable by default), the energy counter probed once, per-GPU readings collected, the library
shut down on close.

Subclasses name the library and give its calls, one GPU handle at a time (energy counter, power, cap, in the
library's units); those stay in their own files (``nvml.py``, ``amdsmi_backend.py``).
"""
from __future__ import annotations

import importlib
from typing import Any

from tokenfab.power.base import PowerBackend, PowerBackendError, check_indices, visible_gpu_indices


class GpuLibraryBackend(PowerBackend):
    """Template for a GPU power backend over a vendor library, for the GPUs ``indices`` (physical indices of the
    library; default: the ones the visibility variable names, or all).

    Subclasses set ``module`` (import name), ``install_hint``, ``label`` (in messages), ``visible_env`` (e.g.
    ``CUDA_VISIBLE_DEVICES``), ``energy_units_per_j`` (the counter's units in one joule: 1000 for mJ) and implement
    :meth:`_init`, :meth:`_shutdown`, :meth:`_handles_of`, :meth:`_energy_raw` (the counter in the library's own
    unit; raising means no counter), :meth:`_power_w` and :meth:`_cap_w`.

    After :meth:`open`: ``self._lib`` is the module, ``self._handles`` one handle per selected GPU,
    ``self._e0`` the counter values at open when ``has_energy_counter``.
    """

    module = ""
    install_hint = ""
    label = ""
    visible_env = "CUDA_VISIBLE_DEVICES"
    energy_units_per_j = 1.0

    def __init__(self, indices: list[int] | None = None) -> None:
        super().__init__()
        self.indices = indices
        self._lib: Any = None
        self._handles: list = []
        self._e0: list[float] = []

    def _init(self, lib) -> None:
        raise NotImplementedError

    def _shutdown(self, lib) -> None:
        raise NotImplementedError

    def _handles_of(self, lib, indices: list[int] | None) -> tuple[int, Any]:
        """(device count, a function index -> handle)."""
        raise NotImplementedError

    def _energy_raw(self, handle) -> float:
        raise NotImplementedError

    def _power_w(self, handle) -> float:
        """Power draw of one GPU in W."""
        raise NotImplementedError

    def _cap_w(self, handle) -> float | None:
        """Configured power cap of one GPU in W (raising or None: unknown)."""
        raise NotImplementedError

    def open(self) -> None:
        """Import and initialise the library, pick the devices and probe the energy counter.

        Raises:
            PowerBackendError: the library is not importable, fails to initialise, sees no GPU, or an index is out of
                range.
        """
        try:
            lib = importlib.import_module(self.module)
        except ImportError as e:
            raise PowerBackendError(f"{self.module} not importable ({e}); {self.install_hint}") from None
        try:
            self._init(lib)
        except Exception as e:  # library not found, driver not loaded, ...
            raise PowerBackendError(f"{self.label} initialisation failed: {e}") from None
        self._lib = lib
        try:
            count, handle = self._handles_of(lib, self.indices)
            if count == 0:
                raise PowerBackendError(f"{self.label} sees no GPU")
            indices = self.indices if self.indices is not None else visible_gpu_indices(count, self.visible_env)
            check_indices(indices, count, self.label)
            self._handles = [handle(i) for i in indices]
            self.devices = [f"gpu{i}" for i in indices]
            try:
                self._e0 = [self._energy_raw(h) for h in self._handles]
                self.has_energy_counter = True
            except Exception:  # not supported on this GPU / driver
                self.has_energy_counter = False
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Shut the library down (errors ignored)."""
        if self._lib is not None:
            try:
                self._shutdown(self._lib)
            except Exception:
                pass
            self._lib = None

    def caps_w(self) -> list[float | None]:
        """Power cap per GPU in W (:meth:`_cap_w`; None where the library cannot say)."""
        out: list[float | None] = []
        for h in self._handles:
            try:
                out.append(self._cap_w(h))
            except Exception:
                out.append(None)
        return out

    def read_energy_j(self) -> list[float] | None:
        """Energy since :meth:`open` per GPU in J: (counter - counter at open) / ``energy_units_per_j``."""
        if not self.has_energy_counter:
            return None
        return [(self._energy_raw(h) - e0) / self.energy_units_per_j for h, e0 in zip(self._handles, self._e0)]

    def read_power_w(self) -> list[float] | None:
        """Power draw per GPU in W (:meth:`_power_w`)."""
        return [self._power_w(h) for h in self._handles]
