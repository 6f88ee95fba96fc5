"""Loading local checkpoints, the MoE adapter, request inputs, tiny and embedded models."""
