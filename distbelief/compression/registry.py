"""The schemes ``--compress`` names, and how a replica builds its codec."""

from __future__ import annotations

from distbelief.compression.base import Codec, Range
from distbelief.compression.fp16 import FP16
from distbelief.compression.powersgd import PowerSGD
from distbelief.compression.qsgd import QSGD
from distbelief.compression.topk import TopK

CODECS = ("none", "fp16", "topk", "qsgd", "powersgd")
_CLASSES = {"fp16": FP16, "topk": TopK, "qsgd": QSGD, "powersgd": PowerSGD}


def codec_class(name: str) -> type[Codec]:
    """The class of scheme ``name`` (its ``decode`` is what a shard runs)."""
    try:
        return _CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; choose from {', '.join(CODECS)}") from None


def describe(name: str, ratio: float = 0.01, bits: int = 4, rank: int = 4) -> str:
    """The scheme with the parameter it reads, as summaries and logs name it (e.g. "topk (ratio 0.01)")."""
    return {"topk": f"topk (ratio {ratio:g})", "qsgd": f"qsgd ({bits} bits)",
            "powersgd": f"powersgd (rank {rank})"}.get(name, name)


def make_codec(name: str, ranges: list[Range], tensors: list[tuple[int, tuple]] | None = None, *,
               ratio: float = 0.01, bits: int = 4, rank: int = 4, seed: int = 0) -> Codec | None:
    """The codec ``name`` for a model whose shards hold ``ranges`` and whose parameters lie at ``tensors``
    (``[(flat offset, shape)]``, PowerSGD only); None for "none". ``seed``: the replica's (QSGD's random rounding,
    PowerSGD's first Q)."""
    if name == "none":
        return None
    if name == "fp16":
        return FP16(ranges)
    if name == "topk":
        return TopK(ranges, ratio)
    if name == "qsgd":
        return QSGD(ranges, bits, seed)
    if name == "powersgd":
        if tensors is None:
            raise ValueError("powersgd needs the model's tensor layout")
        return PowerSGD(ranges, tensors, rank, seed)
    raise ValueError(f"unknown compression {name!r}; choose from {', '.join(CODECS)}")
