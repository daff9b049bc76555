"""The cost of ``quantize_many``'s checks around the native kernel, on a real model's linear weights.

Times, interleaved (one call of each per round, median of ``--runs`` rounds), 1 thread unless ``--threads``:

- ``raw``: the batched native call alone (``NATIVE_PATH.many`` on prepared ``(x2, q, e)`` jobs, no checks);
- ``many``: ``quantize_many(xs, outs=outs)`` of this checkout (every check included);
- ``ref`` (with ``--ref REV``): the same call of ``quantize.py`` as committed at ``REV`` (loaded from git as a
  sibling module of this checkout's package), for a before / after in one run;
- ``copy``: ``copy_`` of the same input bytes in one tensor (the memory-bound ceiling);
- ``many-checks`` / ``ref-checks``: ``many`` / ``ref`` with the native call stubbed out (their Python alone).

The weights are the 2-D ``nn.Linear`` weights of ``mxport.models.load_causal_lm(None)`` (the embedded
SmolLM2-135M), cast to ``--dtype`` (bfloat16 by default), each with preallocated uint8 outputs, as the refit
sender's arena slots. Output: ns per element and ratios, one line each.

    PYTHONPATH=$PWD/src python benchmarks/bench_quantize_many.py --ref HEAD --runs 11
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from mxport.bench.quantize import interleaved_medians

ROOT = Path(__file__).resolve().parent.parent


def _load_ref(rev: str):
    """``mxport/quantize.py`` as committed at ``rev``, as the module ``mxport._quantize_ref``."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/mxport/quantize.py"],
                         check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("mxport._quantize_ref", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "mxport"
    sys.modules[spec.name] = mod
    exec(compile(src, f"{rev}:src/mxport/quantize.py", "exec"), mod.__dict__)
    return mod


def _weights(dtype: torch.dtype) -> list[torch.Tensor]:
    from mxport.models import load_causal_lm

    model, _ = load_causal_lm(None)
    return [m.weight.detach().to(dtype).contiguous() for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2
            and m.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()]


def _checks_only(mod, xs, outs):
    """``mod.quantize_many(xs, outs=outs)`` with its batched native call replaced by nothing."""
    def fn():
        mod.NATIVE_PATH.many = lambda *a, **k: None
        try:
            mod.quantize_many(xs, outs=outs)
        finally:
            del mod.NATIVE_PATH.many
    return fn


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave the default)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    ap.add_argument("--ref", default=None, help="a git revision whose quantize_many to time beside this one")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    q = importlib.import_module("mxport.quantize")
    from mxport.components import compact_scale_shape

    xs = _weights(getattr(torch, args.dtype))
    outs = [(torch.empty(x.shape, dtype=torch.uint8),
             torch.empty(compact_scale_shape(tuple(x.shape), "rowwise"), dtype=torch.uint8)) for x in xs]
    fmt = q.element_format(torch.float8_e4m3fn)
    jobs = [(x.reshape(-1, x.shape[-1]), o[0], o[1]) for x, o in zip(xs, outs, strict=True)]
    flat = torch.cat([x.reshape(-1) for x in xs])
    dst = torch.empty_like(flat)
    fns = {"raw": lambda: q.NATIVE_PATH.many(jobs, fmt, False),
           "many": lambda: q.quantize_many(xs, outs=outs)}
    if args.ref:
        ref = _load_ref(args.ref)
        fns["ref"] = lambda: ref.quantize_many(xs, outs=outs)
    fns["copy"] = lambda: dst.copy_(flat)
    mods = {"many": q} | ({"ref": ref} if args.ref else {})
    for name, mod in mods.items():  # the checks alone: quantize_many with its native call stubbed out
        fns[f"{name}-checks"] = _checks_only(mod, xs, outs)
    q.quantize_many(xs[:1], outs=outs[:1])  # build / load / self-check the kernel outside the timing
    med = interleaved_medians(fns, runs=args.runs, warmup=args.warmup)
    numel = flat.numel()
    print(f"{len(xs)} {args.dtype} linear weights of SmolLM2-135M, {numel / 1e6:.2f} M elements, "
          f"{torch.get_num_threads()} thread(s), median of {args.runs}")
    for k, v in med.items():
        print(f"  {k:11s} {v * 1e3:8.3f} ms  {v / numel * 1e9:6.3f} ns/elem  copy/this {med['copy'] / v:.3f}"
              f"  overhead vs raw {(v - med['raw']) * 1e3:+.3f} ms")


if __name__ == "__main__":
    main()
