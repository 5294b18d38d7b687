"""Speculative decoding in the worker: proposers and the rejection sampler.

A proposer guesses each request's next tokens after a step (ngram.py: prompt lookup;
draft_model.py: a smaller model or a truncated copy of the target; medusa.py: residual heads
over the target's last hidden state). The scheduler schedules the guesses as extra query
tokens of the next step; rejection_sampler.py keeps the longest prefix the target agrees
with (exactly, for greedy rows; in distribution, for random ones) and adds one token.
"""
