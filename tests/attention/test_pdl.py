"""Programmatic dependent launch: which launches take it (one-row launches on Hopper and later, while on), and the
runtime setting that turns it off."""
from __future__ import annotations

import torch

from appliance.attention import pdl
from appliance.config import Config


def test_only_one_row_launches_on_a_capable_gpu_use_it(monkeypatch):
    monkeypatch.setattr(pdl, "_capable", lambda index: index == 0)  # device 0 is Hopper, device 1 older
    monkeypatch.setattr(pdl, "_enabled", True)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert pdl.launch_options(cuda0, 1) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch_options(cuda0, pdl.MAX_ROWS + 1) == {"PDL": False}
    assert pdl.launch_options(cuda1, 1) == {"PDL": False}
    assert pdl.launch_options(torch.device("cpu"), 1) == {"PDL": False}
    pdl.set_enabled(False)
    assert not pdl.active(cuda0, 1) and pdl.launch_options(cuda0, 1) == {"PDL": False}


def test_the_runtime_setting_is_on_by_default_and_can_be_turned_off():
    assert Config.flat().runtime.pdl is True
    assert Config.flat(pdl=False).runtime.pdl is False
