"""The evaluations a run scores while it trains, one module each (`validation`, `hellaswag`), what each declares
(`spec`), and the registry that lists them (`registry`): adding one is its module and one line there."""
