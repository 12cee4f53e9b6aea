"""The optimizers a run can train with: one module each (`adamw`, `muon`), the spec each declares (`spec`) and the
registry of them (`registry`). A new optimizer is its module and one line in the registry."""
