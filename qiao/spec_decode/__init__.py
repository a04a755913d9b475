"""Speculative decoding: propose several next tokens cheaply, verify them in one forward.

A request with proposals ("draft tokens") d_1..d_k is scheduled with 1 + k tokens: its last
sampled token and the drafts, in the same flat batch as every other request. The runner samples
the target's token at each of the 1 + k positions, each under the request's own sampling state as
if the drafts before it had been generated (`verify.expand_sampling_rows`), and keeps the longest
prefix of drafts that equal the target's tokens, plus the target's token after that prefix
(`verify.accept_drafts`). So a step yields 1 to 1 + k tokens, each exactly the token plain
decoding would have produced: greedy output is unchanged, and seeded sampling too (the uniforms
are counter-based on the generation index). For a proposal with probability 1 (the n-gram
lookup's, a greedy draft) this acceptance rule is rejection sampling: the draft is kept with
probability p(d) and, when not, the token comes from p without d, renormalised;
`rejection_sampler` is the general rule for a draft distribution q.

- `ngram.py`: the prompt-lookup proposer (numpy over the request's token array).
- `verify.py`: the sampling rows of a verifying step and the accepted runs, vectorised.
- `rejection_sampler.py`: rejection sampling against a draft distribution q, and its reference.
- `speculator.py`: the engine's side: which requests speculate, their proposals, the counters.
"""
