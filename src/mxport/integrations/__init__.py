"""Engine integrations (each an optional extra; nothing here is imported by ``import mxport``).

- :mod:`mxport.integrations.vllm`: a vLLM ``WeightTransferEngine`` registered as the backend ``"mxport"`` (and
  its trainer-side engine), and an mxport ``WeightSource`` of MXFP8 checkpoint-format pairs for vLLM's own
  engines.
- :mod:`mxport.integrations.sglang`: drives SGLang's ``begin_weight_update`` -> ``update_weights_from_tensor``
  -> ``end_weight_update`` and checks every ``(success, message)``.
"""
