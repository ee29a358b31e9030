"""Seeing what conversion did: the report (`amp_fx.report`) and its text, the captured graphs'
summary (`amp_fx.capture_summary`), DOT drawings, and the ``amp-fx`` command line.
"""
