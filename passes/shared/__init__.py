"""Helpers that more than one pass needs, so that no pass imports another; one module a topic.

Passes import `amp_fx.core`, `amp_fx.ops` and these modules, nothing else of amp_fx; a helper used
by one pass only stays in that pass.

- `calls`: a call's argument by position or keyword, whether it updates in place, which module
  made it;
- `dtypes`: the notes on assumed dtypes and which casts are exact;
- `dtype_rules`: the static dtype rules of `propagate_dtypes` (what a node produces from the dtypes
  it sees), apart from the pass for its size;
- `decisions`: the policy's decision for one node and the storage dtype of every parameter;
- `casts`: amp_fx's cast nodes, shared or one per user, and the casts a node's ``in_dtypes`` ask for;
- `in_place_updates`: which inputs a node updates in place, through views, and the write-back of
  an update that lands on a cast;
- `losses`: which cross-entropy calls the fused loss computes, read from either front end's spelling;
- `linear_loss_chains`: a linear head and its cross-entropy, one description for both front ends
  (the matcher of `fuse_linear_loss` and `fuse_chunked_linear_loss`);
- `op_patterns`: expression patterns over canonical op names, matched whole in the graphs of
  both front ends (for `fuse_activations`), and the node facts every matcher reads;
- `norm_chains`, `rotary_chains`: the RMSNorm / LayerNorm and rotary-embedding chains, matched
  exactly or not at all (the matchers of `fuse_norms` and `fuse_rotary`, apart for their size);
- `affine_masks`: which attention masks are True everywhere or causal, proved by evaluating their
  nodes as affine functions of the element's indices (for `simplify_attention`);
- `model_copy`: the deep copy of a model the front ends convert;
- `traced_graph_module`: the GraphModule the torch.fx front end returns, called like the model;
- `trace_leaves`: what the torch.fx front end keeps whole (primitive leaves, opaque nodes and
  their reasons), apart from `trace` for its size;
- `torch_source`: where torch's own files are (a frame there is not the user's);
- `capture_kernels`: shape kernels torch.export captures with (an FP32 model's `_grouped_mm`).
"""
