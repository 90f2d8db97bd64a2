"""The optimizer: AdamW with its state on device or in pinned host memory, streamed through HBM.

    config             OptimizerConfig: AdamW's hyperparameters (what a recipe's `optimizer` section holds)
    schedule           warmup, then cosine decay
    layouts            LeafLayout per parameter (where its state lives, decay, master copy), from metadata
    adamw              one piece of one leaf's clip + AdamW update: optax's chain, op for op
    optimizer          Optimizer: init, update, shardings, the checkpointed form of the state
    host_streaming     the update streamed through HBM a layer (or a piece of rows) at a time
    update_in_forward  the streamed update run inside the next step's forward pass
    param_placement    which parameters live in host memory (offload.params)
    host_memory        pinned host memory: available, the host's RAM check, host shardings

Imports only `spillway.layers` of this project (docs/DESIGN.md section 2 says why it is a room of its
own; section 6 tells how it works). Modules are imported on use (nothing here).
"""
