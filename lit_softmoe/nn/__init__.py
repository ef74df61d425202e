"""Layers with no I/O."""
from lit_softmoe.nn.routers import ExpertsChoiceMoE, TokensChoiceMoE
from lit_softmoe.nn.soft_moe import BatchedExperts, SoftMoE, slots_for_capacity

__all__ = ["BatchedExperts", "ExpertsChoiceMoE", "SoftMoE", "TokensChoiceMoE", "slots_for_capacity"]
