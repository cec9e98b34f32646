"""Third-party oracles: each library's own attention, fed the canonical parameters.

One module per library: ``torch`` (torch-mha, torch-sdpa), and for JAX ``jax_dpa``
(jax-dpa), ``flax`` and ``equinox`` over their shared base ``jax_common``. Nothing is
re-exported here, so importing one oracle does not import the others' modules.
"""
