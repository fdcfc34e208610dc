"""The ``forward`` check's one rule, on a residual-stream model without a world.

A MoE layer adding ~1e-6 to a stream of ~3 is below the stream's rounding: a wrong dispatch there
moves the model's output by an ulp or two, inside any tolerance that EP's reordered sums need.
``forward_with_layers`` gives each layer's own output as well, and every output is held to a
tolerance of its own scale, so the layer shows it (the negative control) while a layer recomputed
with other rounding passes.  The real-world control is DeepSpeed's
(``tests/test_adapter_deepspeed.py``: router rows swapped while its forward runs).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance.adapter import AdapterError, forward_with_layers
from conformance.checks.forward import forward_problems
from conformance.checks.truth import forward_outputs


class Scaled(nn.Module):
    """A layer of small output (an MoE layer behind a residual stream, as on DeepSpeed's test
    models)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        # a tuple, as DeepSpeed's MoE returns (output, l_aux, ...)
        return torch.tanh(x) * self.scale, None


class Stream(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Scaled(scale) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def _outputs(model: Stream, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    layers = {f"layers.{i}": layer for i, layer in enumerate(model.layers)}
    return forward_outputs(forward_with_layers(lambda: model(batch), layers), "Stream")


def test_a_wrong_layer_behind_a_residual_stream_is_seen_in_its_own_output() -> None:
    batch = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 3
    want = _outputs(Stream(1e-6), batch)
    assert list(want) == ["output", "layers.0", "layers.1"]
    assert forward_problems(_outputs(Stream(1e-6), batch), want) == []

    wrong = Stream(1e-6)
    wrong.layers[0].scale = 1.5e-6  # a layer computing something else, by half its own size
    got = _outputs(wrong, batch)
    # the stream hides it...
    assert forward_problems({"output": got["output"]}, {"output": want["output"]}) == []
    (line,) = forward_problems(got, want)  # ...the layer's own output does not
    assert line.startswith("the forward after the load differs from the ground truth's in output "
                           "'layers.0': element ["), line
    assert (" expected " in line and ", got " in line
            and "= rtol 1e-05 x |expected| + atol 1e-06 x max|expected| 1e-06" in line), line


def test_rounding_of_a_layer_s_own_scale_passes_and_every_output_is_named() -> None:
    want = {"output": torch.full((4,), 3.0), "layers.0": torch.tensor([1e-6, -1e-6, 1e-9, 0.0])}
    noisy = {"output": want["output"] + 2e-5, "layers.0": want["layers.0"] * (1 + 1e-6) + 5e-13}
    assert forward_problems(noisy, want) == []
    both = {"output": want["output"] + 1e-3, "layers.0": want["layers.0"] + 1e-7}
    (line,) = forward_problems(both, want)
    assert line.startswith("the forward after the load differs from the ground truth's: element "
                           "[0] expected 3, got 3.001"), line
    assert line.endswith("4 of 4 elements outside); also outside: 'layers.0'"), line
    assert forward_problems({"output": want["output"]}, want) == [
        "the forward gives outputs ['output'], expected ['output', 'layers.0']"]
    assert ("gives shape (3,), expected (4,)"
            in forward_problems({**want, "layers.0": torch.zeros(3)}, want)[0])
    nan = {**want, "layers.0": torch.tensor([float("nan"), -1e-6, 1e-9, 0.0])}
    assert "element [0] expected 1e-06, got nan" in forward_problems(nan, want)[0]


def test_forward_results_and_layers_are_refused_with_what_was_expected() -> None:
    with pytest.raises(AdapterError,
                       match=r"Stream.forward returned list; expected a tensor or a non-empty "
                                           r"mapping of output names \(str\) to tensors"):
        forward_outputs([torch.zeros(1)], "Stream")
    model = Stream(1.0)
    with pytest.raises(AdapterError, match="'output' names the model's output"):
        forward_with_layers(lambda: model(torch.zeros(1)), {"output": model.layers[0]})
    with pytest.raises(AdapterError, match="layer 'twice' ran more than once"):
        forward_with_layers(lambda: model.layers[0](model.layers[0](torch.zeros(1))[0]),
                            {"twice": model.layers[0]})
    with pytest.raises(AdapterError, match=r"layers \['layers.1'\] did not run"):
        forward_with_layers(lambda: model.layers[0](torch.zeros(1)), {"layers.1": model.layers[1]})
    assert not model.layers[0]._forward_hooks  # hooks removed after a failed run too


def test_a_lower_precision_output_is_held_to_its_own_precision() -> None:
    """bf16 outputs (Megatron's ``--bf16``): the tolerance is in units of the dtype's epsilon, so a
    split sum's rounding passes while a wrong expert's output -- off by its own size -- does not;
    float32's rule is unchanged."""
    from conformance.checks.truth import forward_rtol_atol

    assert (forward_rtol_atol(torch.float32) == (1e-5, 1e-6)
            and forward_rtol_atol(torch.float64) == (1e-5, 1e-6))
    rtol, atol = forward_rtol_atol(torch.bfloat16)
    assert rtol == atol == 8 * 2**-7  # ROUNDING_ULPS units of bf16's epsilon
    want = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16()
    rounded = (want.double() * (1 + 2**-8)).bfloat16()  # an ulp of bf16 on every element
    assert forward_problems({"output": rounded}, {"output": want}) == []
    # another expert's output
    (line,) = forward_problems({"output": want.flip(0)}, {"output": want})
    assert f"rtol {rtol:g} x |expected| + atol {atol:g}" in line, line
