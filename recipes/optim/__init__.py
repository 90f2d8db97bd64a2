"""AdamW with optimizer state in device or pinned host memory, streamed through HBM (docs/DESIGN.md section 6).

Modules are imported on use (nothing here), so importing one stays light.
"""
