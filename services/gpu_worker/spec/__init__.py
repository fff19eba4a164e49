"""Speculative decoding (issue 26): the pure cores, with no engine state.

A proposer guesses the next k tokens of a sequence cheaply (proposer.Proposer; ngram.NgramProposer looks them
up in the sequence itself); the target model scores all k + 1 positions in one forward pass; verify.verify keeps
the longest prefix the target agrees with (greedy) or would have sampled (rejection sampling), plus one token of
the target's own, so every step emits at least one token and the output distribution is exactly the target's.
"""
