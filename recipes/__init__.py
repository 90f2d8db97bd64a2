"""spillway's recipes and everything that runs them.

    config, registry   Recipe dataclasses, --set overrides, the named recipes
    train              the one train step and the loop
    optimizer, host_optimizer   AdamW with device or pinned-host (streamed) state
    checkpoint         orbax checkpoints, resume, fine-tune
    generate           KV-cache sampling
    planner, flops, aot/   deviceless GPU compiles: `spillway plan`
    cli                the `spillway` command

Modules are imported on use (nothing here), so `import recipes.train` stays light.
"""
