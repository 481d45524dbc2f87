"""The interface every power backend implements, and the error raised when one cannot be used.

A backend reads, per device (a GPU, or a CPU package for RAPL):

* a cumulative **energy counter** in J since :meth:`PowerBackend.open` (when the hardware has one; wrap-around and the
  unit conversion are the backend's job), and/or
* an **instantaneous power** reading in W,
* the **configured power cap** in W (the enforced limit), recorded beside the samples.

The sampling thread, windowing and integration live in :mod:`tokenfab.power.monitor`; backends stay thin.
"""
from __future__ import annotations

import os


class PowerBackendError(ValueError):
    """A power backend cannot be used here; the message says why (and, when chosen by flag, names ``--power``)."""

    user_error = True


class PowerBackend:
    """Base class for a power/energy reader over a fixed list of devices.

    Subclasses set :attr:`name`, fill :attr:`devices` (labels such as ``"gpu0"`` or ``"package-0"``) in
    :meth:`open`, and set :attr:`has_energy_counter`.
    """

    name = "base"
    #: True when :meth:`read_energy_j` returns a hardware energy counter (preferred over integrating power).
    has_energy_counter = False
    #: Where the caps come from, in words (e.g. "NVML enforced power limit").
    cap_source = ""

    def __init__(self) -> None:
        self.devices: list[str] = []

    def open(self) -> None:
        """Initialise the library / find the files; raise :class:`PowerBackendError` when unusable."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the library handle (no-op by default)."""

    def caps_w(self) -> list[float | None]:
        """Configured power cap per device in W (None where it cannot be read)."""
        return [None] * len(self.devices)

    def read_energy_j(self) -> list[float] | None:
        """Cumulative energy per device in J since :meth:`open` (monotonic), or None without a counter."""
        return None

    def read_power_w(self) -> list[float] | None:
        """Instantaneous power per device in W, or None when the backend only has an energy counter."""
        return None


def parse_device_list(text: str | None, flag: str = "--power-devices") -> list[int] | None:
    """Parse ``"0,1,3"`` into ``[0, 1, 3]``; None/empty means "all devices". Errors name ``flag``."""
    if text is None:
        return None
    if isinstance(text, (list, tuple)):
        return [int(x) for x in text]
    text = str(text).strip()
    if not text:
        return None
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            idx = int(part)
        except ValueError:
            raise PowerBackendError(f"{flag}: {part!r} is not a device index; give a comma list such as 0,1,2") from None
        if idx < 0:
            raise PowerBackendError(f"{flag}: device index {idx} is negative")
        out.append(idx)
    return out or None


def visible_gpu_indices(count: int, env_var: str = "CUDA_VISIBLE_DEVICES") -> list[int]:
    """Physical indices of the GPUs this process may use: ``env_var`` when it holds integers, else all ``count``.

    NVML and amdsmi number devices physically and ignore CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES; a benchmark
    server limited to some GPUs should be measured on those only.
    """
    raw = os.environ.get(env_var)
    if raw:
        try:
            idx = [int(x) for x in raw.split(",") if x.strip()]
        except ValueError:  # UUIDs or MIG names: measure everything
            return list(range(count))
        idx = [i for i in idx if 0 <= i < count]
        if idx:
            return idx
    return list(range(count))


def check_indices(indices: list[int], count: int, what: str) -> None:
    """Raise :class:`PowerBackendError` naming ``--power-devices`` when an index is outside ``range(count)``."""
    bad = [i for i in indices if i >= count]
    if bad:
        raise PowerBackendError(f"--power-devices: {what} has {count} device(s) (0..{count - 1}); no index {bad}")
