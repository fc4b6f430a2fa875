"""Scale-out: one front end, several engine workers (docs/SCALE_OUT.md)."""
