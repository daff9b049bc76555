"""The step report every ``mxport refit`` run gives, whatever the engine: one training step and its refit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class StepReport:
    """One step (JSON ``steps[i]``): the keys every engine reports, in this order, then the engine's own
    (``details``: the time split, per-receiver or per-rank rows, vLLM's ``kv_fresh``...).

    ``seconds`` is the refit's end to end time, ``gbps`` its payload bytes over it; ``gen_kl_error`` the
    trainer's against the engine's log-probs on the engine's generated tokens (the worst engine rank's);
    ``bit_exact`` every engine rank's bytes equal quantize of the trainer's weights as that rank holds them;
    ``pointers_stable`` no live tensor moved."""

    step: int
    bytes: int
    seconds: float
    gbps: float
    gen_kl_error: float
    bit_exact: bool
    pointers_stable: bool
    details: Mapping = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        clash = sorted(set(self.details) & set(self._keys()))
        if clash:
            raise ValueError(f"details repeat the report's own keys: {clash}")

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        return tuple(k for k in cls.__dataclass_fields__ if k != "details")

    @property
    def ok(self) -> bool:
        """The checks a run must pass: bit-exact, pointers stable, and no stale KV served (vLLM)."""
        return self.bit_exact and self.pointers_stable and bool(self.details.get("kv_fresh", True))

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self._keys()}, **self.details}

    @classmethod
    def from_dict(cls, row: Mapping) -> StepReport:
        """The report of a JSON step (as :meth:`to_dict` wrote it)."""
        keys = cls._keys()
        return cls(**{k: row[k] for k in keys}, details={k: v for k, v in row.items() if k not in keys})
