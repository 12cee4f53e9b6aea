"""The evaluations a run scores while it trains: one module each (`validation`, `hellaswag`), the spec each declares
(`spec`), the registry (`registry`) and the runner (`runner`). A new evaluation is its module and one line in the
registry."""
