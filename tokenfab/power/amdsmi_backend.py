"""AMD GPUs through the ``amdsmi`` Python package (ROCm), with the ``amd-smi`` CLI as a fallback.

amdsmi (imported only when this backend opens):

* energy: ``amdsmi_get_energy_count(h)`` → ``energy_accumulator`` (``power`` before ROCm 6.4) × ``counter_resolution``
  = µJ since the driver loaded;
* power: ``amdsmi_get_power_info(h)`` → ``current_socket_power`` (W), else ``average_socket_power`` (W);
* cap: ``amdsmi_get_power_cap_info(h)`` → ``power_cap`` in µW (values below 10,000 are taken as W, which some
  releases returned).

``amd-smi`` CLI fallback (no energy counter): ``amd-smi metric --power --json`` sampled each interval for socket power
and ``amd-smi static --limit --json`` once for the cap; the JSON is searched for the first ``*socket_power*`` /
``*power_cap*``/``max_power`` value per GPU, since its layout changed between ROCm releases.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any, Callable

from tokenfab.power.base import PowerBackend, PowerBackendError, check_indices, visible_gpu_indices
from tokenfab.power.gpu_library import GpuLibraryBackend


def _num(v: Any) -> float | None:
    """A float out of an amdsmi/amd-smi value (number, "N/A", {"value": x, "unit": "W"})."""
    if isinstance(v, dict):
        v = v.get("value")
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.split()[0])
        except (ValueError, IndexError):
            return None
    return None


def _cap_to_w(v: float | None) -> float | None:
    """amdsmi power caps are µW; small values (< 10,000) are already W."""
    if v is None or v <= 0:
        return None
    return v / 1e6 if v >= 1e4 else v


class AmdSmiBackend(GpuLibraryBackend):
    """amdsmi reader for the GPUs ``indices`` (default: HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES or all)."""

    name = "amdsmi"
    cap_source = "amdsmi power_cap"
    module, label, visible_env = "amdsmi", "amdsmi", "HIP_VISIBLE_DEVICES"
    install_hint = "install the ROCm amdsmi package"
    energy_units_per_j = 1e6  # µJ

    def _init(self, amd) -> None:
        amd.amdsmi_init()

    def _shutdown(self, amd) -> None:
        amd.amdsmi_shut_down()

    def _handles_of(self, amd, indices):
        handles = list(amd.amdsmi_get_processor_handles())
        return len(handles), handles.__getitem__

    def _energy_raw(self, h) -> float:
        """µJ since the driver loaded: energy_accumulator (``power`` before ROCm 6.4) x counter_resolution."""
        d = self._lib.amdsmi_get_energy_count(h)
        acc = d.get("energy_accumulator", d.get("power"))
        return float(acc) * float(d["counter_resolution"])

    def _power_w(self, h) -> float:
        """current_socket_power, else average_socket_power (W); 0.0 when neither reads as a number."""
        info = self._lib.amdsmi_get_power_info(h)
        w = _num(info.get("current_socket_power"))
        if w is None:
            w = _num(info.get("average_socket_power"))
        return w if w is not None else 0.0

    def _cap_w(self, h) -> float | None:
        """power_cap µW / 1e6 (see :func:`_cap_to_w`)."""
        return _cap_to_w(_num(self._lib.amdsmi_get_power_cap_info(h).get("power_cap")))


def _find_key(obj: Any, pred: Callable[[str], bool]) -> Any:
    """Depth-first: the first value whose key satisfies ``pred`` and reads as a number."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if pred(str(k).lower()) and _num(v) is not None:
                return v
        for v in obj.values():
            r = _find_key(v, pred)
            if r is not None:
                return r
    elif isinstance(obj, list):
        for v in obj:
            r = _find_key(v, pred)
            if r is not None:
                return r
    return None


def _per_gpu(doc: Any) -> list[Any]:
    """amd-smi --json gives a list of per-GPU objects (sometimes wrapped in a dict)."""
    if isinstance(doc, dict):
        for v in doc.values():
            if isinstance(v, list):
                return v
        return [doc]
    return list(doc) if isinstance(doc, list) else []


class AmdSmiCliBackend(PowerBackend):
    """Fallback over the ``amd-smi`` command: sampled socket power only (no energy counter)."""

    name = "amdsmi"
    cap_source = "amd-smi static --limit"

    def __init__(self, indices: list[int] | None = None, runner: Callable[[list[str]], str] | None = None,
                 exe: str | None = None) -> None:
        super().__init__()
        self.indices = indices
        self._exe = exe
        self._runner = runner
        self._sel: list[int] = []

    def _run(self, args: list[str]) -> Any:
        cmd = [self._exe or "amd-smi", *args]
        if self._runner is not None:
            text = self._runner(cmd)
        else:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
        return json.loads(text)

    def open(self) -> None:
        """Find ``amd-smi`` on PATH and read the GPU list once."""
        if self._runner is None:
            self._exe = self._exe or shutil.which("amd-smi")
            if not self._exe:
                raise PowerBackendError("amd-smi not on PATH")
        try:
            gpus = _per_gpu(self._run(["metric", "--power", "--json"]))
        except Exception as e:
            raise PowerBackendError(f"amd-smi metric --power --json failed: {e}") from None
        if not gpus:
            raise PowerBackendError("amd-smi lists no GPU")
        indices = self.indices if self.indices is not None else visible_gpu_indices(len(gpus), "HIP_VISIBLE_DEVICES")
        check_indices(indices, len(gpus), "amd-smi")
        self._sel = indices
        self.devices = [f"gpu{i}" for i in indices]

    def caps_w(self) -> list[float | None]:
        """Power cap per GPU in W from ``amd-smi static --limit --json``."""
        try:
            gpus = _per_gpu(self._run(["static", "--limit", "--json"]))
        except Exception:
            return [None] * len(self._sel)
        out: list[float | None] = []
        for i in self._sel:
            v = _find_key(gpus[i], lambda k: "power_cap" in k or k in ("max_power", "socket_power_limit")) \
                if i < len(gpus) else None
            w = _num(v)
            out.append(_cap_to_w(w) if w is not None and w >= 1e4 else w)
        return out

    def read_power_w(self) -> list[float] | None:
        """Socket power per GPU in W from ``amd-smi metric --power --json``."""
        gpus = _per_gpu(self._run(["metric", "--power", "--json"]))
        out = []
        for i in self._sel:
            v = _find_key(gpus[i], lambda k: "socket_power" in k and "limit" not in k) if i < len(gpus) else None
            w = _num(v)
            out.append(w if w is not None else 0.0)
        return out
