"""TOKENFAB_TRITON_AUTOTUNE (kernels/gpu/support.py): tuning only when set to 1 and never in Triton's interpreter;
otherwise each kernel's first config; anything but 0 / 1 refused by name when an engine starts."""
from __future__ import annotations

import pytest

from tokenfab.errors import EngineConfigError
from tokenfab.kernels.gpu import support


@pytest.mark.parametrize("interp,value,want", [("0", None, False), ("0", "0", False), ("0", "1", True),
                                               ("1", "1", False), ("1", None, False)])
def test_autotune_switch(monkeypatch, interp, value, want):
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    if value is None:
        monkeypatch.delenv("TOKENFAB_TRITON_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("TOKENFAB_TRITON_AUTOTUNE", value)
    assert support.autotune_enabled() is want
    assert support.autotune_configs(["a", "b", "c"]) == (["a", "b", "c"] if want else ["a"])


def test_bad_value_refused_by_name(monkeypatch):
    monkeypatch.setenv("TOKENFAB_TRITON_AUTOTUNE", "yes")
    monkeypatch.delenv("TOKENFAB_TRITON", raising=False)
    with pytest.raises(EngineConfigError, match="TOKENFAB_TRITON_AUTOTUNE='yes'.*use 1"):
        support.check_env()
