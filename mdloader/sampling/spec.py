"""How one data section samples, as one value: what ``input.json`` says, taken whole.

A :class:`SamplingSpec` is built once from a data section (``mdloader.config`` builds it from
``training.training_data`` and the others) and handed whole to the plan
(:meth:`mdloader.sampling.plan.LoaderPlan.build`), which checks and applies it. No sampling
option travels on its own through the loader set or the sampler: they read the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mdloader.sampling.probability import select_prob_source


@dataclass(frozen=True)
class SamplingSpec:
    """The sampling keys of one data section.

    Attributes
    ----------
    batch_size
        DeePMD-kit's ``batch_size`` (an int, one int per system, or a rule such as ``"auto"``,
        ``"auto:N"``, ``"max:N"``, ``"filter:N"``: :mod:`mdloader.sampling.batching`).
    auto_prob, sys_probs
        The system probabilities: ``sys_probs`` when given, else the ``auto_prob`` style
        (DeePMD-kit's precedence).
    shuffle
        Shuffle the frames of each pass (always on in DeePMD-kit's distributed mode).
    same_system_across_ranks
        Every rank draws the same system at each step (still disjoint frames).
    balance_window, balance_cost
        Balanced steps (``docs/sampling.md``): windows of ``balance_window`` steps (0: off) dealt
        so that each step's ranks cost about the same under the cost model ``balance_cost``.
    json_path
        Where the section sits in ``input.json`` (``training.training_data``), named by errors.
    """

    batch_size: int | tuple[int, ...] | str = "auto"
    auto_prob: str = "prob_sys_size"
    sys_probs: tuple[float, ...] | None = None
    shuffle: bool = True
    same_system_across_ranks: bool = False
    balance_window: int = 0
    balance_cost: str = "atoms"
    json_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, list):
            object.__setattr__(self, "batch_size", tuple(self.batch_size))
        if self.sys_probs is not None and not isinstance(self.sys_probs, tuple):
            object.__setattr__(self, "sys_probs", tuple(self.sys_probs))

    @classmethod
    def of_params(cls, batch_size: int | Sequence[int] | str,
                  params: Mapping[str, Any] | None = None, **options: Any) -> SamplingSpec:
        """A spec from DeePMD-kit's values: ``batch_size`` and a data section's
        ``sys_probs``/``auto_prob`` (``params``), plus any other field of the spec."""
        params = params or {}
        probs = params.get("sys_probs")
        return cls(batch_size=batch_size if isinstance(batch_size, (int, str))  # type: ignore[arg-type]
                   else tuple(batch_size), auto_prob=params.get("auto_prob", "prob_sys_size"),
                   sys_probs=None if probs is None else tuple(probs), **options)

    def key(self, name: str) -> str:
        """The JSON path of the section's key ``name`` (just ``name`` without a section path)."""
        return f"{self.json_path}.{name}" if self.json_path else name

    def batch_size_value(self) -> int | list[int] | str:
        """``batch_size`` as DeePMD-kit passes it (a list, not a tuple)."""
        return list(self.batch_size) if isinstance(self.batch_size, tuple) else self.batch_size

    def sampler_params(self) -> dict[str, Any]:
        """The dict DeePMD-kit's ``get_sampler_from_params`` reads (``sys_probs`` wins)."""
        params: dict[str, Any] = {"auto_prob": self.auto_prob}
        if self.sys_probs is not None:
            params["sys_probs"] = list(self.sys_probs)
        return params

    def probability_source(self) -> tuple[Any, bool, str]:
        """(the style or the list, whether it is ``sys_probs``, its JSON path)."""
        value, is_sys_probs, name = select_prob_source(self.sampler_params())
        return value, is_sys_probs, self.key(name)


__all__ = ["SamplingSpec"]
