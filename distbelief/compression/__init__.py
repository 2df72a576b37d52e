"""Compressed pushes: what a replica sends a shard instead of its float32 gradient range.

A scheme (``Codec``) turns the replica's gradient ``a`` (the new gradient plus what earlier compressions left out)
into one part per shard, sized for the wire; the shard decodes its part into the dense float32 range it applies.
The replica decodes the same parts with the same code, so what it believes it sent is bit for bit what the shards
apply, and ``ErrorFeedback`` keeps the difference (``a - sent``) for the next push: nothing the compression left
out is lost, only delayed.

Schemes (``--compress``), each in its own module:

- ``fp16`` (fp16.py): every value as a float16. 2 bytes per value.
- ``topk`` (topk.py, ``--compress-ratio``): per shard range the ``ceil(ratio * n)`` values of largest magnitude,
  with their int32 positions. 8 bytes per value kept.
- ``qsgd`` (qsgd.py, ``--compress-bits``): QSGD (Alistarh et al., 2017): per bucket of 512 values its norm and,
  per value, a sign and a level randomly rounded so that the decoded gradient is unbiased; ``bits`` per value.
- ``powersgd`` (powersgd.py, ``--compress-rank``): PowerSGD (Vogels et al., 2019): each weight matrix as a rank-r
  product ``P Qᵀ`` with a warm-started power iteration, the arithmetic of torch's ``powerSGD_hook``; vectors
  (biases) and matrices too small to gain are sent as they are.

``make_codec(name, ranges, tensors, ...)`` builds one; ``CODECS`` lists them.
"""

from distbelief.compression.base import Codec, wire_bytes
from distbelief.compression.feedback import ErrorFeedback
from distbelief.compression.registry import CODECS, codec_class, make_codec
from distbelief.compression.wire import EncodedPush, EncodedRange, dense_push

__all__ = ["CODECS", "Codec", "EncodedPush", "EncodedRange", "ErrorFeedback", "codec_class", "dense_push",
           "make_codec", "wire_bytes"]
