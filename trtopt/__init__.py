"""trtopt."""
