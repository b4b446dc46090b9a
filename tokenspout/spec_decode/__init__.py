"""Speculative decoding: draft proposers (the verification math lives in sample/rejection_sampler.py)."""

from tokenspout.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer"]
