"""mxport.integrations.vllm_slices without vLLM: how plan tensors map onto a model's live parameters, on
torch modules shaped as vLLM's (a layer whose kernel is not one mxport re-derives takes the layerwise path,
staged in checkpoint layout)."""

import torch

from mxport.integrations.vllm_slices import live_slices
from mxport.refit import Box, Holding
from mxport.refit.mesh import TensorInfo


class _OtherKernel:  # a kernel mxport does not know: its layer is re-processed by vLLM (layerwise)
    pass


def _model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(64, 8, bias=False)
    model.proj.quant_method = type("Method", (), {"kernel": _OtherKernel()})()
    return model


def _holdings() -> list[Holding]:
    return [Holding(TensorInfo("proj.weight", "kept", "float32", (8, 64)), Box.full((8, 64)))]


def test_a_layerwise_layer_is_staged_in_checkpoint_layout():
    live, layers = live_slices(_model(), _holdings())
    (layer,) = layers
    assert layer.path == "layerwise" and layer.kernel == "_OtherKernel"
    staged = layer.staged["weight"]
    assert staged.device.type == "cpu" and staged.shape == (8, 64)
    box, view = live["proj.weight"]
    assert box == Box.full((8, 64)) and view.data_ptr() == staged.data_ptr()  # the refit lands in staging


def test_a_check_only_mapping_allocates_nothing():
    """init_weight_transfer_engine(check_only=True) checks the plan against the worker, and keeps nothing:
    the staged buffers it maps are on the meta device."""
    live, layers = live_slices(_model(), _holdings(), check_only=True)
    assert layers[0].path == "layerwise" and layers[0].staged["weight"].device.type == "meta"
    assert live["proj.weight"][1].device.type == "meta"


def test_a_box_larger_than_the_live_parameter_is_a_clear_error():
    import pytest

    too_big = [Holding(TensorInfo("proj.weight", "kept", "float32", (16, 64)), Box.full((16, 64)))]
    for check_only in (False, True):
        with pytest.raises(ValueError, match=r"proj.weight: the engine's proj.weight has 8 rows"):
            live_slices(_model(), too_big, check_only=check_only)
