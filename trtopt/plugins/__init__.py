"""trtopt ops: one folder per op, each with the five faces of DESIGN.md §4."""
