"""Power telemetry for benchmark runs: energy, average power and caps per device, under a power cap.

Backends (``--power``): ``nvml`` (NVIDIA, nvidia-ml-py), ``amdsmi`` (AMD, amdsmi or the amd-smi CLI), ``rapl`` (Linux
powercap, per CPU package) and ``none``; ``auto`` tries nvml, amdsmi, rapl in that order and says which it picked.
Vendor libraries are imported only when a backend opens, so this package imports on any machine.

Energy comes from hardware energy counters where the device has one (NVML total-energy mJ, amdsmi accumulator,
RAPL energy_uj with wrap-around); otherwise from power sampled every ``--power-interval`` seconds (default 2) in a
background thread and integrated with the trapezoid rule. Configured caps are recorded beside the samples.

Why our own thin backends and not zeus or codecarbon (judged from their docs, code and issue trackers):

* zeus (ML.ENERGY, ``zeus-ml``) has the right readings (ZeusMonitor windows on NVML/amdsmi counters, RAPL, power
  limits through its device layer), but it pulls in pandas, scikit-learn (for ``auc``), pydantic and tyro, and its
  PowerMonitor polls in *spawned processes* that re-import the caller's main module — heavy and fragile inside
  ``tokenfab bench serve``. What we need from it is ~300 lines over NVML/amdsmi/sysfs.
* codecarbon targets CO2 estimates: a 15 s default scheduler, per-component cumulative kWh and last-sample power,
  no power caps, GPU energy read as zero on GPUs without an NVML counter (mlco2/codecarbon#1316), and location
  lookups. It does not give per-device samples, caps or arbitrary steady-state windows.

Modules: :mod:`.base` (interface), :mod:`.nvml`, :mod:`.amdsmi_backend`, :mod:`.rapl`, :mod:`.monitor` (sampling
thread, windows, backend selection), :mod:`.bench_hook` (the ``tokenfab bench serve`` integration).
"""
from tokenfab.power.base import PowerBackend, PowerBackendError
from tokenfab.power.monitor import PowerMonitor, select_backend

__all__ = ["PowerBackend", "PowerBackendError", "PowerMonitor", "select_backend"]
