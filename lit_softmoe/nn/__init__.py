"""Layers with no I/O."""
from lit_softmoe.nn.soft_moe import BatchedExperts, SoftMoE, slots_for_capacity

__all__ = ["BatchedExperts", "SoftMoE", "slots_for_capacity"]
