"""Helpers that two passes or more need, so that no pass imports another; one module a topic.

Passes import `amp_fx.core`, `amp_fx.ops`, `amp_fx.kernels` and these modules, nothing else of
amp_fx; a helper of one pass lives in that pass's folder (`fuse_norms/norm_chains.py`), and the
front ends' helpers in `amp_fx.capture` (`tests/test_layers.py` checks both).

- `conversion`: the one context of a conversion every pass takes (`Conversion`: policy, example
  inputs, the front end's facts, the parameter plan) and torch.fx's `PassResult` every pass returns;
- `call_nodes`: a call's argument by position or keyword, whether it updates in place, which
  module made it;
- `dtypes`: the notes on assumed dtypes and which casts are exact;
- `decisions`: the policy's decision for one node and the storage dtype of every parameter;
- `casts`: amp_fx's cast nodes, shared or one per user, and the casts a node's ``in_dtypes`` ask for;
- `cast_walk`: walking dtype casts, the one way every matcher does: the dtype a cast converts to,
  the value under a chain of casts, the reshapes and casts a value's readers go through;
- `in_place_updates`: which inputs a node updates in place, through views, and the write-back of
  an update that lands on a cast;
- `losses`: which cross-entropy calls the fused loss computes, read from either front end's spelling;
- `fused_calls`: putting a fused call in place of a matched chain, the one way every fusion pass
  does (the call, its NodeInfo and inherited metadata, the readers rewired, the chain erased);
- `linear_loss_chains`: a linear head and its cross-entropy, one description for both front ends
  (the matcher of `fuse_linear_loss` and `fuse_chunked_linear_loss`), and `linear_loss_calls`,
  their one replacement of a matched head and loss;
- `module_regions`: the ops one module computed, cut out of a graph into a submodule
  (`checkpoint_regions`, `shard_regions`);
- `op_patterns`: expression patterns over canonical op names, matched whole in the graphs of
  both front ends, and the node facts every matcher reads.
"""
