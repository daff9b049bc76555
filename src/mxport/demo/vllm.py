"""A trainer process refitting a real vLLM engine through the ``"mxport"`` backend.

The engine (``vllm.LLM``) runs in this process, the trainer in a spawned child that drives vLLM's weight-sync
calls through a pipe (:class:`PipeClient`, a ``VLLMWeightSyncClient``) while it broadcasts over gloo. Used by
:func:`run_vllm_refit_demo` (``mxport refit --engine vllm``) and the tests.

The trainer's weights at step ``k`` are :func:`trainer_weights` (the source checkpoint plus a seeded
perturbation per tensor for ``k > 0``), so any process can rebuild them and check the engine's bytes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from .report import StepReport

#: messages on the pipe are JSON (never pickle); tensors travel as raw bytes after a JSON header
_RPC = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
        "reset_prefix_cache")
PROMPTS = ("The weights arrive in blocks of thirty-two", "Refit moves the trainer's weights")
#: vLLM's KV block on CPUs (16 tokens on GPUs): the demo's long prompt spans more than two of them, so that a
#: refit that left the prefix cache in place would serve it from KV computed with the previous weights
CPU_KV_BLOCK = 128


def trainer_weights(src_dir: str | os.PathLike, step: int, scale: float = 0.02,
                    density: float = 1.0) -> dict[str, torch.Tensor]:
    """The trainer's bf16 weights at ``step``: the checkpoint in ``src_dir``, plus for ``step > 0`` a seeded
    Gaussian perturbation of each floating tensor (``scale`` x its RMS; seed from the name and step), of a
    seeded ``density`` fraction of its elements when below 1 (a delta refit's sparse steps). The same bytes
    in every process, whatever its thread count."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(src_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    if step:
        for name, t in out.items():
            if t.is_floating_point():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1_000_003 * step)
                # the RMS rounded to 3 digits: float sums depend on the thread count, and every process that
                # rebuilds these weights must get the same bytes
                rms = max(float(f"{t.double().pow(2).mean().sqrt().item():.3g}"), 1e-6)
                noise = scale * rms * torch.randn(t.shape, generator=g)
                if density < 1:
                    noise *= torch.rand(t.shape, generator=g) < density
                out[name] = (t.float() + noise).to(t.dtype)
    return out


def export_step(src_dir: str | os.PathLike, step: int, out: str | os.PathLike) -> str:
    """An ``mxport export`` (modelopt) of the trainer's step-``step`` weights as the harness trainer holds
    them (:func:`trainer_weights` in BF16), under ``out/step<k>-mx``: what vLLM's own ``reload_weights`` takes
    to reach the same bytes as a refit of that step. Returns the export's directory."""
    import shutil

    from safetensors.torch import save_file

    from ..checkpoint.export import export_checkpoint

    out = Path(out)
    hf = out / f"step{step}-hf"
    shutil.copytree(src_dir, hf, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
               for n, t in trainer_weights(src_dir, step).items()}
    save_file(weights, str(hf / "model.safetensors"))
    export_checkpoint(str(hf), out / f"step{step}-mx")
    shutil.rmtree(hf)
    return str(out / f"step{step}-mx")


# -- pipe RPC
# ---------------------------------------------------------------------------------------------------------
def _send(conn, obj: dict) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def _recv(conn) -> dict:
    obj = json.loads(conn.recv_bytes(maxlength=64 << 20))
    if not isinstance(obj, dict):
        raise ValueError("pipe message is not a JSON object")
    return obj


class PipeClient:
    """``VLLMWeightSyncClient`` for a trainer whose engine is in the parent process (see :func:`serve_step`):
    each call is one JSON request and one JSON answer on the pipe."""

    def __init__(self, conn):
        self.conn = conn

    def _call(self, name: str, arg=None):
        _send(self.conn, {"call": name, "arg": arg})
        reply = _recv(self.conn)
        if reply.get("error"):
            raise RuntimeError(f"engine {name}: {reply['error']}")
        return reply.get("result")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:  # noqa: ARG002
        self._call("finish_weight_update")

    def reset_prefix_cache(self) -> bool:
        """``LLM.reset_prefix_cache()`` in the engine's process (what the trainer engine calls after a
        refit)."""
        return bool(self._call("reset_prefix_cache"))


def _engine_call(llm, name: str, arg):
    if name == "init_weight_transfer_engine":
        return llm.init_weight_transfer_engine({"init_info": arg})
    if name == "update_weights":
        return llm.update_weights({"update_info": arg})
    return getattr(llm, name)()


def serve_step(llm, conn, request: dict | None, timeout_s: float) -> dict:
    """Send ``request`` (if any) to the trainer, serve its engine calls on ``llm`` until it answers.

    Returns the answer (``{"error": ...}`` when the trainer died or failed)."""
    if request is not None:
        _send(conn, request)
    calls: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            return {"error": f"trainer did not answer within {timeout_s} s"}
        try:
            msg = _recv(conn)
        except (EOFError, OSError) as exc:
            return {"error": f"trainer is gone ({type(exc).__name__})"}
        if "call" not in msg:
            return {**msg, "engine_calls_s": calls}
        if msg["call"] not in _RPC:
            return {"error": f"unknown engine call {msg['call']!r}"}
        try:
            t0 = time.perf_counter()
            result = _engine_call(llm, msg["call"], msg.get("arg"))
            t1 = time.perf_counter()
            calls[msg["call"]] = t1 - t0
            calls.setdefault("first_call_t", t0)
            calls["last_call_t"] = t1
            reply = {"ok": True, "result": result if isinstance(result, (bool, int, float, str)) else None}
        except Exception as exc:  # noqa: BLE001 - reported to the trainer and the caller
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            _send(conn, reply)
        except (BrokenPipeError, OSError):
            return {"error": f"trainer is gone; engine said {reply}"}


# -- the trainer process
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainerConfig:
    source: str  # bf16 HF model directory (the trainer's step-0 weights)
    port: int
    timeout_s: float = 30.0
    bucket_bytes: int = 1 << 20
    engines: int = 1  # the engines' workers (tensor-parallel ranks x replicas)
    replica_addresses: tuple = ()  # the engine_server replicas' listeners
    authkey: str = ""  # their key (hex)
    trainers: int = 1  # trainer ranks (several: an FSDP2-sharded model, each rank sending its pieces)
    trainer_port: int = 0  # their own group's port
    delta: bool = False  # delta refits; each step then perturbs a sparse subset (:data:`DELTA_DENSITY`)


#: with --delta, the fraction of each tensor's elements a step perturbs (sparse, as optimizer steps at small
#: learning rates change few MXFP8 bytes; the dense default changes nearly every byte)
DELTA_DENSITY = 1e-3


def _density(delta: bool) -> float:
    return DELTA_DENSITY if delta else 1.0


def _load_step(model, src: str, step: int, delta: bool = False) -> None:
    from ..sources.dtensor import is_dtensor

    w = trainer_weights(src, step, density=_density(delta))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in w:
                if is_dtensor(p):  # this rank's shard of the full tensor
                    from torch.distributed.tensor import distribute_tensor

                    p.copy_(distribute_tensor(w[name].to(p.dtype), p.device_mesh, p.placements))
                else:
                    p.copy_(w[name])


class _ForgedDigest:
    """A client whose ``update_weights`` names another plan: the engine refuses it before reading the stream
    while the trainer sends (what a confused or hostile trainer does)."""

    def __init__(self, client):
        self.inner = client

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def update_weights(self, update_info):
        return self.inner.update_weights({**update_info, "plan_digest": "0" * 64})


def _set_fault(engine, fault: str | None) -> None:
    """Tests' faults: on the wire (:class:`mxport.testing.FaultyTransport`, which tampers with a copy of each
    outgoing bucket) "corrupt" flips a bit of bucket 0, "kill" ends the trainer process at bucket 1; "digest"
    has the engine's update call name another plan."""
    from ..testing import FaultyTransport

    stream = engine.sender.streams[0]
    inner = getattr(stream.transport, "inner", stream.transport)
    engine.clients = [getattr(c, "inner", c) for c in engine.clients]
    if fault is None:
        stream.transport = inner
        return
    if fault == "digest":
        engine.clients = [_ForgedDigest(c) for c in engine.clients]
        return
    if fault == "corrupt":
        def fn(refit, bucket, wire):
            if bucket == 0:
                wire[:1].bitwise_xor_(1)
    elif fault == "kill":
        def fn(refit, bucket, wire):
            if bucket == 1:
                os._exit(3)
    else:
        raise ValueError(f"unknown fault {fault!r}")
    stream.transport = FaultyTransport(inner, stream.layout.num_buckets, fn)


def _trainer_step(engine, model, cfg: TrainerConfig, req: dict) -> dict:
    _load_step(model, cfg.source, int(req["step"]), cfg.delta)
    _set_fault(engine, req.get("fault"))
    try:
        engine.send_weights()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return {"error": f"{type(exc).__name__}: {exc}"}
    stats = engine.last_stats.to_dict() if hasattr(engine.last_stats, "to_dict") else dict(engine.last_stats)
    streams = [{"engines": list(x["engines"]), "bytes": x["bytes"]} for x in stats.get("streams", [])]
    blocks = [-1, 0]
    if cfg.delta and stats.get("changed_words", -1) >= 0:
        from ..refit.stream.delta import streams_block_counts

        blocks = list(streams_block_counts(engine.sender.streams))
    return {"ok": True, "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
            "streams": streams, "blocks": blocks}


def _score(model, req: dict) -> dict:
    """Log-softmax of the trainer's logits at every generated position of ``prompt + tokens``."""
    ids = torch.tensor([list(req["prompt"]) + list(req["tokens"])])
    with torch.no_grad():
        logits = model(ids).logits[0, len(req["prompt"]) - 1:-1].float()
    if callable(getattr(model, "reshard", None)):  # FSDP2 keeps the root's parameters unsharded after a
        model.reshard()  # forward: the next step's weights must land in the shards the refit reads
    return {"ok": True, "logp": torch.log_softmax(logits, -1).tolist()}


def _trainer_model(cfg: TrainerConfig, rank: int):
    """The trainer's model: BF16 from ``cfg.source``; with several trainer ranks, sharded with FSDP2
    ``fully_shard`` over them (their own gloo group, the default one of this process)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.source, dtype=torch.bfloat16)
    if cfg.trainers > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg.trainer_port}",
                                             rank=rank, world_size=cfg.trainers)
        mesh = init_device_mesh("cpu", (cfg.trainers,))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _share(req: dict | None, cfg: TrainerConfig) -> dict:
    """Trainer rank 0's request (from the parent) on every trainer rank (JSON bytes over their group)."""
    if cfg.trainers == 1:
        return req
    data = json.dumps(req).encode() if req is not None else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    torch.distributed.broadcast(n, 0)
    buf = torch.zeros(int(n), dtype=torch.uint8)
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    torch.distributed.broadcast(buf, 0)
    return json.loads(buf.numpy().tobytes())


def trainer_main(conn, cfg_dict: dict, rank: int = 0) -> None:
    """Entry point of a trainer child process (``rank`` of ``cfg.trainers``): rank 0 talks to the parent's
    engine on ``conn`` and to each :func:`engine_server` replica at its address; the other ranks send the
    pieces they hold of the FSDP2-sharded model."""
    from ..integrations.vllm import MxportTrainerInitInfo, MxportWeightSource, register

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory  # isort: skip

    torch.set_num_threads(1)
    cfg = TrainerConfig(**cfg_dict)
    register()
    model = _trainer_model(cfg, rank)
    source = MxportWeightSource(model)
    info = MxportTrainerInitInfo(master_address="127.0.0.1", master_port=cfg.port,
                                 world_size=cfg.trainers + cfg.engines, trainers=cfg.trainers, rank=rank,
                                 timeout_s=cfg.timeout_s, bucket_bytes=cfg.bucket_bytes, delta=cfg.delta)
    try:
        from multiprocessing.connection import Client

        replicas = [Client(tuple(a), authkey=bytes.fromhex(cfg.authkey)) for a in cfg.replica_addresses]
        clients = [PipeClient(c) for c in (conn, *replicas)] if rank == 0 else [None]
        engine = WeightTransferTrainerFactory.trainer_init(info, client=clients if replicas else clients[0],
                                                           source=source)
    except Exception as exc:  # noqa: BLE001 - reported to the parent (the engine refused the plan, say)
        if conn is not None:
            _send(conn, {"error": f"{type(exc).__name__}: {exc}"})
            conn.close()
        os._exit(2)  # at once, whatever the refused init left behind
    if rank == 0:
        sender = engine.sender
        layouts = [s.layout for s in sender.streams]
        buckets = {"buckets": sum(x.num_buckets for x in layouts), "bucket_bytes": layouts[0].bucket_bytes,
                   "engine_bytes": sender.mesh.engine_bytes(), "trainer_ranks": cfg.trainers}
        _send(conn, {"ok": True, "plan": {**source.plan.summary(), **buckets}})
    while True:
        try:
            req = _share(_recv(conn) if rank == 0 else None, cfg)
        except (EOFError, OSError):
            req = _share({"cmd": "stop"}, cfg) if rank == 0 else {"cmd": "stop"}
        answer = _serve_trainer(engine, model, cfg, req, rank)
        if rank == 0 and answer is not None:
            _send(conn, answer)
        if req.get("cmd") not in ("step", "score", "raw"):
            engine.shutdown()
            return


def _serve_trainer(engine, model, cfg: TrainerConfig, req: dict, rank: int) -> dict | None:
    """One request on one trainer rank; rank 0's answer for the parent."""
    cmd = req.get("cmd")
    if cmd == "step":
        return _trainer_step(engine, model, cfg, req)
    if cmd == "score":
        return _score(model, req)  # every rank runs the model: FSDP2 gathers each layer among them
    if cmd == "raw" and rank == 0:
        return {"ok": True, "seconds": raw_broadcast(0, int(req["port"]), int(req["nbytes"]),
                                                     int(req.get("reps", 3)), cfg.timeout_s)}
    return None


def raw_broadcast(rank: int, port: int, nbytes: int, reps: int, timeout_s: float) -> float:
    """Best of ``reps`` plain gloo broadcasts of ``nbytes`` bytes (no plan, no checksums, no engine).

    The floor a refit of the same bytes is compared with."""
    from ..refit import TorchDistTransport
    from ..refit.transport import open_group

    t = TorchDistTransport.from_group(open_group("127.0.0.1", port, rank, 2, timeout_s=timeout_s,
                                                 prefix="mxport-raw"))
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        t.broadcast(buf)
        best = min(best, time.perf_counter() - t0)
    t.close()
    return best


def _stop(procs, conn) -> None:
    """Ask a trainer (or replica engine) to stop, then make sure its processes have."""
    if conn is not None:
        try:
            _send(conn, {"cmd": "stop"})
        except OSError:
            pass
        conn.close()
    for proc in procs if isinstance(procs, list) else [procs] if procs is not None else []:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def start_trainer(cfg: TrainerConfig):
    """Spawn the trainer ranks; returns ``(processes, parent's end of rank 0's pipe)``."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    procs = [ctx.Process(target=trainer_main, args=(child if r == 0 else None, cfg.__dict__, r), daemon=True,
                         name=f"mxport-trainer-{r}") for r in range(cfg.trainers)]
    for p in procs:
        p.start()
    child.close()
    return procs, parent


# -- the engine side
# ---------------------------------------------------------------------------------------------------
def engine_env() -> dict[str, str]:
    """Environment for an in-process CPU vLLM engine that keeps MXFP8 bytes as loaded (set before import)."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD": "0",
            "MXPORT_VLLM_CPU_EMULATION": "1"}


def _context_len(model_dir: str, cap: int = 512) -> int:
    """``cap``, or the model's own context length (``max_position_embeddings``) when shorter."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return min(cap, int(cfg.get("max_position_embeddings") or cap))


def _bind_cpus(tp: int) -> None:
    """vLLM's CPU workers each bind to cores (``VLLM_CPU_OMP_THREADS_BIND``, one list per worker): one core
    each, round robin over this process's cores, unless the variable is set."""
    cores = sorted(os.sched_getaffinity(0))
    given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if len(given.split("|")) != tp:  # unset, "auto", or a list for another tp
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[i % len(cores)]) for i in range(tp))
        import vllm.envs

        # an engine started earlier in this process froze vLLM's view of the environment
        getattr(vllm.envs, "disable_envs_cache", lambda: None)()


def start_engine(mx_dir: str, *, max_model_len: int | None = None, full_logprobs: bool = True, tp: int = 1):
    """A ``vllm.LLM`` on the MXFP8 checkpoint ``mx_dir`` with the ``"mxport"`` weight-transfer backend
    (``max_model_len`` None: 512 tokens, or the model's context when shorter).

    The engine gets ``weight_transfer_config={"backend": "mxport"}``. On CPU, vLLM's emulation kernel is
    enabled for this process (:func:`~mxport.integrations.vllm.enable_cpu_emulation`); returns
    ``(llm, emulated)``."""
    for k, v in engine_env().items():
        os.environ.setdefault(k, v)
    from vllm import LLM

    from ..integrations.vllm import enable_cpu_emulation, register

    register()
    emulated = enable_cpu_emulation()
    parallel = {}
    if tp > 1:
        if emulated:
            _bind_cpus(tp)
        parallel = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
    llm = LLM(model=mx_dir, max_model_len=max_model_len or _context_len(mx_dir), enforce_eager=True,
              **parallel, dtype="bfloat16", max_num_seqs=4, seed=0, kv_cache_memory_bytes=64 << 20,
              max_logprobs=-1 if full_logprobs else 20,
              weight_transfer_config={"backend": "mxport"})
    return llm, emulated


def generate(llm, prompt_ids: list[list[int]], max_tokens: int = 8, full: bool = True) -> list[dict]:
    """Greedy generation: per prompt ``tokens`` and ``logprobs`` (each generated token's).

    With ``full``, also the whole log-prob row per position (``logp``, a [T, V] tensor)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=-1 if full else 0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        toks = list(c.token_ids)
        r = {"tokens": toks, "logprobs": [float(d[t].logprob) for d, t in zip(c.logprobs, toks, strict=True)]}
        if full:
            vocab = max(max(d) for d in c.logprobs) + 1
            logp = torch.full((len(toks), vocab), float("-inf"))
            for i, d in enumerate(c.logprobs):
                ids = torch.tensor(list(d.keys()))
                logp[i, ids] = torch.tensor([v.logprob for v in d.values()])
            r["logp"] = logp
        res.append(r)
    return res


def _params(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in m.named_parameters() if p.numel() > 0}


def _pointers(m) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in m.named_parameters()}


def engine_tensors(llm, rank: int = 0) -> dict[str, torch.Tensor]:
    """CPU copies of worker ``rank``'s parameters (as its loader stores them), less those it keeps elsewhere:
    on x86 CPUs with AVX-512 vLLM's CPU GEMM dispatch repacks a BF16 linear (the lm_head) into a oneDNN
    handle and leaves its ``weight`` empty (``vllm/model_executor/layers/utils.py``), which cannot be read
    back."""
    return llm.apply_model(_params)[rank]


def engine_pointers(llm) -> list[dict[str, int]]:
    """Every worker's parameter pointers."""
    return llm.apply_model(_pointers)


_CHECKS = ("stats", "pieces", "attest", "pointers", "generate")


def _check(llm, req: dict):
    """A parent's question to a replica engine (see :class:`ReplicaEngine`)."""
    from ..integrations import vllm as mxv

    cmd = req["cmd"]
    if cmd == "stats":
        return llm.collective_rpc(mxv.worker_stats)
    if cmd == "pieces":
        return llm.collective_rpc(mxv.worker_pieces)
    if cmd == "attest":
        return mxv.attest(llm)
    if cmd == "pointers":
        return engine_pointers(llm)
    return [{"tokens": o["tokens"], "logprobs": o["logprobs"]}
            for o in generate(llm, req["prompts"], max_tokens=int(req.get("max_tokens", 8)), full=False)]


def engine_server(ctl, mx_dir: str, tp: int, max_model_len: int | None, authkey: str) -> None:
    """A replica engine's process: a ``vllm.LLM`` on ``mx_dir`` serving trainers' weight-sync calls on a
    ``multiprocessing`` listener (JSON messages after its HMAC handshake) and the parent's checks on
    ``ctl``."""
    import threading
    from multiprocessing.connection import Listener, wait

    llm, emulated = start_engine(mx_dir, max_model_len=max_model_len, tp=tp)
    listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(authkey))
    _send(ctl, {"ok": True, "address": list(listener.address), "emulated": emulated})
    conns, new = [ctl], []

    def accept() -> None:  # trainers connect at any time (a new one before the old one leaves)
        while True:
            new.append(listener.accept())

    threading.Thread(target=accept, daemon=True).start()
    while True:
        conns += [new.pop() for _ in range(len(new))]
        for c in wait(conns, timeout=0.2):
            try:
                msg = _recv(c)
            except (EOFError, OSError):
                conns.remove(c)
                if c is ctl:
                    return
                continue
            if c is ctl and msg.get("cmd") == "stop":
                return
            try:
                if c is ctl:
                    reply = {"ok": True, "result": _check(llm, msg)}
                elif msg.get("call") in _RPC:
                    result = _engine_call(llm, msg["call"], msg.get("arg"))
                    plain = isinstance(result, (bool, int, float, str))
                    reply = {"ok": True, "result": result if plain else None}
                else:
                    reply = {"error": f"unknown engine call {msg.get('call')!r}"}
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            _send(c, reply)


class ReplicaEngine:
    """A second (third, ...) vLLM engine on the same checkpoint, in a process of its own
    (:func:`engine_server`): a data-parallel replica the trainer refits in the same refit."""

    def __init__(self, mx_dir: str, tp: int, max_model_len: int | None, authkey: str, timeout_s: float = 300):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=engine_server, args=(child, mx_dir, tp, max_model_len, authkey),
                                daemon=True, name="mxport-replica")
        self.proc.start()
        child.close()
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"replica engine did not start within {timeout_s} s")
        hello = _recv(self.conn)
        self.address = tuple(hello["address"])

    def ask(self, cmd: str, **kw):
        _send(self.conn, {"cmd": cmd, **kw})
        reply = _recv(self.conn)
        if reply.get("error"):
            raise RuntimeError(f"replica engine {cmd}: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        _stop(self.proc, self.conn)


class VllmRefitSession:
    """An in-process vLLM engine on ``mx_dir`` and a trainer child process starting from ``src_dir``."""

    def __init__(self, src_dir: str, mx_dir: str, *, timeout_s: float = 30.0, bucket_bytes: int = 1 << 20,
                 max_model_len: int | None = None, tp: int = 1, replicas: int = 1, trainers: int = 1,
                 delta: bool = False):
        import secrets

        from .procs import free_port

        self.src_dir, self.timeout_s, self.bucket_bytes, self.tp = src_dir, timeout_s, bucket_bytes, tp
        self.trainers, self.delta = trainers, delta
        self.authkey = secrets.token_hex(16)
        self.replicas = [ReplicaEngine(mx_dir, tp, max_model_len, self.authkey) for _ in range(replicas - 1)]
        self.llm, self.emulated = start_engine(mx_dir, max_model_len=max_model_len, tp=tp)
        self.proc = self.conn = None  # trainer rank 0's process (the one on the pipe) and its pipe
        self.procs: list = []  # every trainer rank's
        self._free_port = free_port
        self.plan_summary = self.connect()

    def connect(self, src_dir: str | None = None) -> dict:
        """Start a trainer (from ``src_dir``, default the session's) and run the weight-transfer init
        handshake through vLLM. Once the engine accepts it, it replaces the session's trainer; if the engine
        refuses it (RuntimeError with the engine's message), the session's trainer stays connected."""
        src = self.src_dir if src_dir is None else str(src_dir)
        cfg = TrainerConfig(src, self._free_port(), self.timeout_s, self.bucket_bytes,
                            self.tp * (1 + len(self.replicas)), tuple(r.address for r in self.replicas),
                            self.authkey, self.trainers, self._free_port(), self.delta)
        procs, conn = start_trainer(cfg)
        ans = serve_step(self.llm, conn, None, self.timeout_s + 120)
        if ans.get("error"):
            _stop(procs, conn)
            raise RuntimeError(f"trainer init failed: {ans['error']}")
        self.close_trainer()
        self.procs, self.proc, self.conn, self.src_dir = procs, procs[0], conn, src
        return ans["plan"]

    def refit(self, step: int, fault: str | None = None) -> dict:
        """One refit of the trainer's step-``step`` weights (``fault``: "corrupt" a bucket, "kill" the trainer
        mid-transfer). Returns the trainer's answer plus ``wall_s``."""
        t0 = time.perf_counter()
        ans = serve_step(self.llm, self.conn, {"cmd": "step", "step": step, "fault": fault},
                         self.timeout_s + 60)
        ans["wall_s"] = time.perf_counter() - t0
        return ans

    def score(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        ans = serve_step(self.llm, self.conn, {"cmd": "score", "prompt": prompt, "tokens": tokens}, 120)
        if ans.get("error"):
            raise RuntimeError(f"trainer scoring failed: {ans['error']}")
        return torch.tensor(ans["logp"])

    def close_trainer(self) -> None:
        _stop(self.procs, self.conn)
        self.procs, self.proc, self.conn = [], None, None

    def pointers(self) -> list[dict]:
        """Every worker's parameter pointers, the replicas' after this process's engine's."""
        return [*engine_pointers(self.llm), *(x for r in self.replicas for x in r.ask("pointers"))]

    def close(self) -> None:
        """The trainer, then the replica engines' processes."""
        self.close_trainer()
        for r in self.replicas:
            r.close()

    def engine_stats(self) -> list[dict]:
        """Every worker's stats of its last refit (``apply_s``, ``apply_paths``, ``attested``, ``bytes``,
        ``host_bytes``, ...)."""
        from ..integrations.vllm import worker_stats

        return [*self.llm.collective_rpc(worker_stats), *(x for r in self.replicas for x in r.ask("stats"))]

    def raw_broadcast_s(self, nbytes: int, reps: int = 3) -> float:
        """Seconds of a plain gloo broadcast of ``nbytes`` between the trainer and this process.

        The best of ``reps`` broadcasts."""
        import threading

        port = self._free_port()
        th = threading.Thread(target=raw_broadcast, args=(1, port, nbytes, reps, self.timeout_s), daemon=True)
        th.start()
        ans = serve_step(self.llm, self.conn, {"cmd": "raw", "port": port, "nbytes": nbytes, "reps": reps},
                         self.timeout_s + 60)
        th.join(self.timeout_s)
        if ans.get("error"):
            raise RuntimeError(f"raw broadcast failed: {ans['error']}")
        return float(ans["seconds"])


# -- checks and the demo
# ---------------------------------------------------------------------------------------------
def expected_engine_bytes(src_dir: str, step: int, engine: dict[str, torch.Tensor], packed: dict,
                          density: float = 1.0) -> dict[str, torch.Tensor]:
    """What vLLM's loader stores for the trainer's step-``step`` bf16 weights: ``mxport.quantize`` of each
    weight, fused projections (``packed``: vLLM's ``packed_modules_mapping``) concatenated along N. Engine
    tensors without a trainer counterpart (a tied lm_head) are left out."""
    from .. import quantize

    w = {n: t.to(torch.bfloat16) if t.is_floating_point() else t
         for n, t in trainer_weights(src_dir, step, density=density).items()}
    out = {}
    for name, t in engine.items():
        comps = name.split(".")
        hf = [name]
        for fused, parts in packed.items():
            if fused in comps:
                hf = [".".join(p if c == fused else c for c in comps) for p in parts]
        base = [h.removesuffix("_scale") for h in hf]
        if any(b not in w for b in base):
            continue
        if name.endswith(".weight_scale"):
            out[name] = torch.cat([quantize(w[b]).scale_inv for b in base])
        elif t.dtype == torch.float8_e4m3fn:
            out[name] = torch.cat([quantize(w[b]).data for b in base])
        else:
            out[name] = torch.cat([w[h] for h in hf])
    return out


def engine_mismatches(session: VllmRefitSession, step: int) -> list[str]:
    """Engine tensors whose bytes differ from :func:`expected_engine_bytes`.

    Quantized weights with no trainer counterpart count as differing; empty when the engine holds exactly the
    trainer's step-``step`` weights."""
    eng = engine_tensors(session.llm)
    packed = session.llm.apply_model(lambda m: dict(getattr(m, "packed_modules_mapping", {}) or {}))[0]
    want = expected_engine_bytes(session.src_dir, step, eng, packed, _density(session.delta))
    bad = [f"{n} (no trainer weight)" for n, t in eng.items()
           if t.dtype == torch.float8_e4m3fn and n not in want]
    for name, w in want.items():
        t = eng[name]
        if t.dtype != w.dtype or t.shape != w.shape:
            bad.append(f"{name} ({t.dtype} {tuple(t.shape)} vs {w.dtype} {tuple(w.shape)})")
        elif not torch.equal(t.view(torch.uint8), w.view(torch.uint8)) if t.dtype.itemsize == 1 else \
                not torch.equal(t, w):
            bad.append(name)
    return bad


def slice_mismatches(session: VllmRefitSession, step: int) -> list[str]:
    """Every worker's boxes whose live bytes (checkpoint layout) differ from ``mxport.quantize`` of the
    trainer's step-``step`` weights cut to that box; each as ``rank N: name[box]``."""
    from .. import quantize
    from ..integrations.vllm import worker_pieces
    from ..refit.attest import bytes_digest
    from ..refit.mesh import Box

    w = {n: t.to(torch.bfloat16) if t.is_floating_point() else t
         for n, t in trainer_weights(session.src_dir, step, density=_density(session.delta)).items()}
    bad, cache = [], {}

    def full(name: str) -> torch.Tensor:
        if name not in cache:
            base = name.removesuffix("_scale")
            quantized = name != base or f"{name}_scale" in names
            c = quantize(w[base]) if quantized else None
            cache[name] = w[name] if c is None else (c.scale_inv if name != base else c.data)
        return cache[name]

    every = [*session.llm.collective_rpc(worker_pieces),
             *(x for r in session.replicas for x in r.ask("pieces"))]
    for rank, pieces in enumerate(every):
        names = {p[0] for p in pieces}
        for name, start, stop, digest in pieces:
            box = Box(tuple(start), tuple(stop))
            known = name.removesuffix("_scale") in w
            if not known or bytes_digest(full(name)[box.index()]) != digest:
                bad.append(f"rank {rank}: {name}{box}")
    return bad


def _prompts(session: VllmRefitSession, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """The demo's prompts: the refit demo's question (at most 48 tokens), and a long one spanning more than
    two CPU KV blocks (the question's tokens repeated; shorter where the model's context is)."""
    from .words import PROMPT

    short = list(session.llm.get_tokenizer()(PROMPT)["input_ids"])[:48]
    room = session.llm.llm_engine.model_config.max_model_len - max_new_tokens  # a model of a short context
    n = min(2 * CPU_KV_BLOCK + 40, room)
    return short, (short * (n // len(short) + 1))[:n]


def _same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def _step_row(session: VllmRefitSession, step: int, ans: dict, prompts: tuple[list[int], list[int]],
              max_new_tokens: int, ptr0: dict) -> dict:
    from ..metrics import gen_kl_error

    prompt, long = prompts
    gen = generate(session.llm, [prompt], max_tokens=max_new_tokens)[0]
    # the long prompt was served before this refit: its answer now must be computed with the new weights,
    # the same as once the prefix cache is emptied by hand
    seen = generate(session.llm, [long], max_tokens=max_new_tokens, full=False)[0]
    session.llm.reset_prefix_cache()
    fresh = generate(session.llm, [long], max_tokens=max_new_tokens, full=False)[0]
    logp_train = session.score(prompt, gen["tokens"])
    v = min(gen["logp"].shape[-1], logp_train.shape[-1])
    kl = gen_kl_error(gen["logp"][:, :v], logp_train[:, :v])
    st, calls = ans["stats"], ans["engine_calls_s"]
    # the independent check reads vLLM's FP8 parameters: one engine of one worker that kept them (vLLM's
    # default decodes MXFP8 to BF16 at load: there the workers' checkpoint-layout read-back is compared)
    decoded = os.environ.get("VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD") != "0"
    sliced = session.tp > 1 or session.replicas or decoded
    bad = slice_mismatches(session, step) if sliced else engine_mismatches(session, step)
    seconds = calls["last_call_t"] - calls["first_call_t"]  # start_weight_update .. prefix cache reset
    workers = session.engine_stats()
    ranks = [{"rank": r, "bytes": int(x.get("wire_bytes", x.get("bytes", 0))),
              "full_bytes": int(x.get("bytes", 0)), "delta": bool(x.get("delta")),
              "attested": bool(x.get("attested")),
              "apply_s": float(x.get("apply_s", 0.0)), "apply_paths": x.get("apply_paths", {}),
              "device_bytes": int(x.get("buffer_bytes", 0)), "host_bytes": int(x.get("host_bytes", 0))}
             for r, x in enumerate(workers)]
    received = sum(r["bytes"] for r in ranks)  # into every worker (several trainer ranks sent parts of it)
    hit, total = ans.get("blocks", (-1, 0))
    delta = {"full_bytes": sum(r["full_bytes"] for r in ranks), "delta": all(r["delta"] for r in ranks),
             "blocks_changed": hit / total if hit >= 0 and total else None} if session.delta else {}
    return StepReport(
        step=step, bytes=received, seconds=seconds,
        gbps=received / seconds / 1e9 if seconds > 0 else 0.0, gen_kl_error=kl["mean"], bit_exact=not bad,
        pointers_stable=session.pointers() == ptr0,
        details={"transfer_s": st["seconds"], "apply_s": max(r["apply_s"] for r in ranks),
                 "attested": bool(st.get("attested")) and all(r["attested"] for r in ranks), "ranks": ranks,
                 "gen_kl_error_max": kl["max"], "mismatches": bad[:8], "kv_fresh": _same(seen, fresh),
                 "prefix_cache_reset": bool(st.get("prefix_cache_reset")), "long_prompt_tokens": len(long),
                 "tokens": gen["tokens"], "engine": "vllm", **delta}).to_dict()


def run_vllm_refit_demo(source: str, *, steps: int = 3, bucket_bytes: int = 64 << 20,
                        max_new_tokens: int = 16, timeout_s: float = 120.0, workdir: str | None = None,
                        on_event=None, tp: int = 1, replicas: int = 1, trainers: int = 1,
                        delta: bool = False) -> dict:
    """``mxport refit SOURCE --engine vllm[,tp=N]``: export ``source`` (an HF model directory) as MXFP8, start
    a real vLLM engine on it (``tp`` > 1: tensor-parallel workers, each refitted with its own slice;
    ``weight_transfer_config={"backend": "mxport"}``; on CPU with vLLM's emulation kernel added), start a
    trainer process, and refit ``steps`` times through vLLM's weight-transfer calls.

    The trainer's weights at step k are :func:`trainer_weights` (a seeded perturbation of the source, not an
    optimizer step). ``on_event(kind, rank, payload)`` sees the plan (``"plan"``) and each step as it finishes
    (``"step"``), as the other demos report them. Per step: ``step``, ``bytes`` (refit payload),
    ``seconds`` (from vLLM's ``start_weight_update`` to the end of the prefix-cache reset after
    ``finish_weight_update``: transfer, checks, layerwise reload, reset; the trainer's weight update before it
    is not counted), ``gbps``, ``transfer_s`` (the sender's bucketed broadcast alone, quantize included),
    ``apply_s`` (the worker's layerwise reload of the validated refit), ``gen_kl_error`` (mean KL(engine ||
    trainer) over the engine's greedy tokens, from vLLM's full log-probs and the trainer's bf16 logits),
    ``bit_exact`` (engine bytes == mxport.quantize of the trainer's weights as vLLM stores them),
    ``pointers_stable``, with ``delta`` (each step perturbing a sparse :data:`DELTA_DENSITY` of the
    elements) ``full_bytes``, ``delta``, ``blocks_changed``; ``kv_fresh`` (a prompt of more than two KV
    blocks, served before the refit, is answered after it exactly as after emptying the prefix cache by hand:
    no KV of the previous weights was reused), ``prefix_cache_reset`` (the trainer engine reset it),
    ``engine: "vllm"``. Returns ``{"engine", "steps", "plan", "bf16_bytes", "raw_broadcast_s",
    "cpu_emulation"}``.
    """
    import tempfile

    from ..checkpoint.export import export_checkpoint

    with tempfile.TemporaryDirectory(prefix="mxport-vllm-", dir=workdir) as tmp:
        mx = str(Path(tmp) / "mxfp8")
        export_checkpoint(source, mx)
        session = VllmRefitSession(source, mx, timeout_s=timeout_s, bucket_bytes=bucket_bytes, tp=tp,
                                   replicas=replicas, trainers=trainers, delta=delta)
        say = on_event or (lambda kind, rank, payload: None)
        try:
            say("plan", 0, session.plan_summary)
            ptr0, prompts, rows = session.pointers(), _prompts(session, max_new_tokens), []
            generate(session.llm, [prompts[1]], max_tokens=max_new_tokens, full=False)  # cached at step 0
            for k in range(1, steps + 1):
                ans = session.refit(k)
                if not ans.get("ok"):
                    raise RuntimeError(f"refit step {k} failed: {ans.get('error')}")
                rows.append(_step_row(session, k, ans, prompts, max_new_tokens, ptr0))
                say("step", 0, rows[-1])
            plan = session.plan_summary
            raw = session.raw_broadcast_s(plan["bytes"])
        finally:
            session.close()
    by_role = plan["bytes_by_role"]
    return {"engine": "vllm", "engine_layout": f"tp={tp}", "steps": rows, "plan": plan,
            "raw_broadcast_s": raw,
            "bf16_bytes": by_role["values"] * 2 + by_role["kept"], "cpu_emulation": session.emulated}
