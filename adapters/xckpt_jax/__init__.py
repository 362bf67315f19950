"""JAX adapter of xckpt: ``jax.Array`` sources and targets, pytree containers, the jax.distributed coordinator.

Importing it (``xckpt`` does so by itself once ``jax`` is imported) registers with
:mod:`xckpt.registry`:

* sources: ``jax.Array`` of any sharding; each process lists the shards it holds,
  their device-to-host copies started asynchronously at once (typed PRNG keys as their key data);
* targets: ``jax.ShapeDtypeStruct`` (its sharding; none: this process's first
  device), a real ``jax.Array`` (its sharding and dtype), or a bare
  ``jax.sharding.Sharding`` (stored shape and dtype); a sharding over an abstract mesh takes
  the mesh set by ``jax.set_mesh``; a typed PRNG key target wraps the stored key data; each
  process reads only the regions of its addressable devices;
* containers: custom pytree nodes (flax, optax, ``register_pytree_node``);
* coordinator: the ``jax.distributed`` key-value store when more than one process runs.
"""

from __future__ import annotations

import jax

from xckpt import registry

from . import arrays, coordinator, pytrees
from .arrays import array_source, sharded_target
from .coordinator import JaxCoordinator

__all__ = ["JaxCoordinator", "array_source", "sharded_target", "arrays", "coordinator", "pytrees"]

registry.register_source(arrays.is_jax_array, arrays.array_source)
registry.register_target(lambda x: isinstance(x, jax.ShapeDtypeStruct), arrays.struct_target)
registry.register_target(arrays.is_jax_array, arrays.array_target)
registry.register_target(lambda x: isinstance(x, jax.sharding.Sharding), arrays.sharding_target)
registry.register_container(pytrees.is_custom_node, pytrees.save_view, pytrees.load_view)
registry.register_coordinator(coordinator.default_coordinator)
