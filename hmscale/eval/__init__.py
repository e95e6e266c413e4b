from hmscale.eval.perplexity import mean_nll, perplexity, unigram_perplexity

__all__ = ["mean_nll", "perplexity", "unigram_perplexity"]
