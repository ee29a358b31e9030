"""Runtime ops that converted graphs call, beneath the passes: the fp32 cross-entropy losses
(`cross_entropy`, and chunked with the head in `chunked_cross_entropy`; the head's matmuls both
use in `head_matmuls`), fused BatchNorm + ReLU (`batch_norm`), max pooling (`max_pool`), fp32
activations alone or gating a projection (`activations`), fp32 RMSNorm / LayerNorm with the
residual add before them (`norms`), rotary embeddings (`rotary`), autocast islands for opaque
parts (`autocast_island`), the guarded cast (`casts`), and their dispatch
helpers. They import only `amp_fx.core` and `amp_fx.kernels`; each fused op's module is named for
its kernel family in `amp_fx.kernels`.
"""
