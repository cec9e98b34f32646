"""The layer split over several devices or processes by heads (tensor parallelism).

``jax`` (jax-sharded) and ``torch`` (torch-tp) over ``common`` (the `ShardedBackend` base
and the head gather) and ``workers`` (the worker processes both use).
"""
