"""Model execution: model loading, the model runner (packed batch -> logits), the paged-attention
glue into transformers, the sampler, and the multi-process tensor-parallel executor.
"""
