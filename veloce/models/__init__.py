"""Recommendation models built on veloce embeddings: ``DLRM`` and ``DeepFM``.

Both take ``forward(dense, sparse)`` with ``sparse`` a ``(B, F)`` int64 tensor of raw ids
and return ``(B,)`` logits; ``embedding_factory`` chooses the embedding module (default
``veloce.DynamicEmbedding``).
"""

from veloce.models._common import EmbeddingFactory, default_embedding_factory
from veloce.models.deepfm import DeepFM
from veloce.models.dlrm import DLRM

__all__ = ["DLRM", "DeepFM", "EmbeddingFactory", "default_embedding_factory"]
