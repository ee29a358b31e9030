"""Graph passes of the convert pipeline, one pass a file; installed as `amp_fx.passes`.

The order they run in is written once, in `amp_fx.pipeline.PASSES`.
"""
