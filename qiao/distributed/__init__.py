"""Tensor parallelism over torch.distributed: the process group and its collectives."""
