"""``genworker.core.torch_stack``: the command that fixes a torchvision built for another
torch takes the torch variant's index, and the message names both versions and the error."""

from __future__ import annotations

from genworker.core.torch_stack import torchvision_fix, torchvision_problem


def test_the_fix_takes_the_torch_variant_s_index() -> None:
    assert torchvision_fix("2.9.0+cu128", "0.24.0").startswith(
        "pip install --force-reinstall --no-deps 'torchvision==0.24.0+cu128' "
        "--index-url https://download.pytorch.org/whl/cu128"
    )
    assert torchvision_fix("2.9.0", "0.25.0+cpu").startswith(
        "pip install --force-reinstall --no-deps 'torchvision==0.25.0'  (or"
    )


def test_the_problem_names_both_versions_the_error_and_the_fix() -> None:
    message = torchvision_problem("2.13.0+cpu", "0.28.0", "RuntimeError: nms")
    assert message.startswith(
        "torchvision 0.28.0 cannot load beside torch 2.13.0+cpu (RuntimeError: nms); "
        "transformers imports it and would then load no model. Run: pip install "
    )
    assert message.endswith("torchcodec); see docs/install.md")
