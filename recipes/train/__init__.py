"""The train runtime: loop, step and loss, optimizer with host streaming, checkpoints, metrics,
multi-host set-up and the data pipeline. Modules are imported on use (nothing here)."""
