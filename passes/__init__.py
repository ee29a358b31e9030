"""Graph passes of the convert pipeline, one pass a file; installed as `amp_fx.passes`."""
