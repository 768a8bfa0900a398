"""Tensor parallelism (Megatron's split of each layer over a tensor group): the parallel layers
(layers), the plans that say which module is split how (plan; a Hugging Face model's own tp_plan,
its styles in local, partial, region, experts and mla), a split parameter's slice (shard), the
set-up probe and the audit that prove a split model equal to the whole one (probe, audit)."""
