"""The optimizers a run can train with, one module each (`adamw`, `muon`), what each declares (`spec`), and the
registry that lists them (`registry`): adding an optimizer is its module and one line there."""
