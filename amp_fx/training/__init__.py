"""Training with a converted model: the loss scaler, gradient clipping, the CUDA-graph step,
data parallelism (DDP's overflow agreement, FSDP2 sharding) and saving the FP32 masters.

The public names are amp_fx's own: ``amp_fx.LossScaler``, ``amp_fx.clip_grad_norm_``,
``amp_fx.CudaGraphStep``, ``amp_fx.master_state_dict``; FSDP2 is `amp_fx.training.fsdp`.
"""
