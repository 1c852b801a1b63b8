"""A warm-up manifest's torch.compile entry (``[[torch]] callable = "torch_warm.py:warm"``):
builds, compiles and runs the tests' small model, and says so if it went wrong."""

from __future__ import annotations

import torch_model


def warm() -> None:
    report = torch_model.run(width=56)
    if not report["ok"]:
        raise AssertionError("the compiled model's outputs differ from eager's")
