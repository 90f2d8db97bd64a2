"""spillway's recipes and everything that runs them.

    config, registry     the Recipe dataclasses, --set overrides, the named recipes
    train/               the train runtime: step and loss, loop, optimizer with host
                         streaming, checkpoints, metrics, multi-host, data pipeline
    plan/                `spillway plan`: the planner, its FLOP model, deviceless GPU compiles
    sampling             KV-cache sampling from a model
    generate             `spillway generate`: sample from a run's checkpoint
    cli                  the `spillway` command

Modules are imported on use (nothing here), so importing one stays light.
"""
