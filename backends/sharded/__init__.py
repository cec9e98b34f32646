"""The layer split over several devices or processes by heads (tensor parallelism).

``jax`` (jax-sharded) and ``torch`` (torch-tp) over ``common`` (the `ShardedBackend` base
and the head gather, and the decode requests) and ``workers`` (the worker processes both use);
``jax_decode`` and ``torch_decode`` are the worker side of each one's KV-cache decoding.
"""
