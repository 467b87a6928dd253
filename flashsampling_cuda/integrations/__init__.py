"""Integrations of FlashSampling with other libraries.

Each integration is a submodule that imports its library only when it is itself
imported, so ``import flashsampling_cuda`` never needs them:

- :mod:`flashsampling_cuda.integrations.transformers`: decode Hugging Face causal LMs
  (Llama, Mistral, Qwen2/Qwen3, Gemma) with ``flashsampling.sample`` in place of
  lm_head + logits processors + ``torch.multinomial``, on a static KV cache with
  CUDA-graph steps. Needs the ``transformers`` extra
  (``pip install 'flashsampling-cuda[transformers]'``).
"""

__all__ = ["transformers"]
