"""CPU packages through Linux RAPL (powercap sysfs), one device per package zone.

Zones ``/sys/class/powercap/intel-rapl:N`` (AMD Zen CPUs use the same ``intel-rapl`` driver) are read; sub-zones
(``intel-rapl:N:M``: core, uncore, dram) are skipped so nothing is counted twice.

* energy: ``energy_uj`` (µJ), which wraps to 0 after ``max_energy_range_uj``: a step Δ < 0 is read as
  Δ + max_energy_range_uj. Reading more often than one wrap period (minutes at full power) keeps this exact.
* cap: the ``constraint_K_power_limit_uw`` whose ``constraint_K_name`` is ``long_term`` (else constraint 0), in µW.

Since Linux 5.10 ``energy_uj`` is readable by root only (CVE-2020-8694); the backend then refuses to open and says so.
"""
from __future__ import annotations

import os
import re

from tokenfab.power.base import PowerBackend, PowerBackendError

DEFAULT_ROOT = "/sys/class/powercap"
_PKG = re.compile(r"^intel-rapl:(\d+)$")


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


def _read_str(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


class RaplBackend(PowerBackend):
    """RAPL package-energy reader; ``indices`` selects packages (the N of ``intel-rapl:N``), default all."""

    name = "rapl"
    has_energy_counter = True
    cap_source = "RAPL long_term power limit"

    def __init__(self, indices: list[int] | None = None, root: str = DEFAULT_ROOT) -> None:
        super().__init__()
        self.indices = indices
        self.root = root
        self._zones: list[str] = []
        self._max_uj: list[int] = []
        self._last_uj: list[int] = []
        self._acc_uj: list[int] = []

    def open(self) -> None:
        """Find package zones and take the first counter reading (raises when unreadable)."""
        if not os.path.isdir(self.root):
            raise PowerBackendError(f"{self.root} does not exist (no powercap/RAPL driver)")
        zones = {}
        for entry in os.listdir(self.root):
            m = _PKG.match(entry)
            if m:
                zones[int(m.group(1))] = os.path.join(self.root, entry)
        if not zones:
            raise PowerBackendError(f"no intel-rapl:N package zone under {self.root}")
        indices = self.indices if self.indices is not None else sorted(zones)
        missing = [i for i in indices if i not in zones]
        if missing:
            raise PowerBackendError(f"--power-devices: RAPL has packages {sorted(zones)}; no package {missing}")
        self._zones = [zones[i] for i in indices]
        self.devices = [_read_str(os.path.join(z, "name"), f"package-{i}") for i, z in zip(indices, self._zones)]
        try:
            self._last_uj = [_read_int(os.path.join(z, "energy_uj")) for z in self._zones]
        except PermissionError:
            raise PowerBackendError(
                "RAPL energy_uj is not readable by this user (root-only since Linux 5.10); run as root or "
                "grant read access to /sys/class/powercap/intel-rapl:*/energy_uj") from None
        except (OSError, ValueError) as e:
            raise PowerBackendError(f"RAPL energy_uj unreadable: {e}") from None
        self._max_uj = []
        for z in self._zones:
            try:
                self._max_uj.append(_read_int(os.path.join(z, "max_energy_range_uj")))
            except (OSError, ValueError):
                self._max_uj.append(2 ** 32)
        self._acc_uj = [0] * len(self._zones)

    def caps_w(self) -> list[float | None]:
        """Long-term package power limit per package in W (µW / 1e6)."""
        out: list[float | None] = []
        for z in self._zones:
            k_pick = 0
            for k in range(4):
                if _read_str(os.path.join(z, f"constraint_{k}_name")) == "long_term":
                    k_pick = k
                    break
            try:
                out.append(_read_int(os.path.join(z, f"constraint_{k_pick}_power_limit_uw")) / 1e6)
            except (OSError, ValueError):
                out.append(None)
        return out

    def read_energy_j(self) -> list[float] | None:
        """Energy since :meth:`open` per package in J, unwrapping ``energy_uj`` with ``max_energy_range_uj``."""
        for i, z in enumerate(self._zones):
            cur = _read_int(os.path.join(z, "energy_uj"))
            delta = cur - self._last_uj[i]
            if delta < 0:
                delta += self._max_uj[i]
            self._acc_uj[i] += delta
            self._last_uj[i] = cur
        return [a / 1e6 for a in self._acc_uj]
