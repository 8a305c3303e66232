"""Decoding a trained model: greedy, sampled and beam search (``search``), the decoder's
attention maps over the image grid (``attention_maps``) and the compile options both use
(``jit``). Below the evaluators, which decode with it, and above the models it runs."""
