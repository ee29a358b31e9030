"""Seeing what conversion did: the report (`amp_fx.report`) and its text, the captured graphs'
summary (`amp_fx.capture_summary`), DOT drawings, the ``amp-fx`` command line; and what the
converted model computes: value ranges recorded per node (`amp_fx.watch`), the op that overflowed
(`amp_fx.find_overflow`) and policy rules that avoid it (`amp_fx.propose_policy`).
"""
