"""Test-session setup: 8 fake CPU devices, so sharding tests see a real mesh.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before
anything imports jax; pytest imports conftest.py first.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
