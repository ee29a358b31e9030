"""Policy data beneath the passes: opt levels and dtypes (`dtypes`), torch.autocast's op lists
(`op_lists`), the `Policy` that maps each op to a rule (`policy`), and what the passes record on
each fx node (`node_info`). Imports nothing of amp_fx above it.
"""
