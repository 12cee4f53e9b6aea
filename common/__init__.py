"""What every package may import: error types, the run folder's layout, atomic writes.

Imports nothing from the rest of the project, so no package can form a cycle through it.
"""
