"""The GRPO math: pure tensor functions with shape comments, every variant a parameter.

``advantages`` (group statistics and normalisation), ``turn_credit`` (per-turn advantages of multi-turn
episodes: discounted returns, GiGPO step groups), ``losses`` (token log-probs, the clipped surrogate, KL
estimators, aggregation), ``kl_control`` (fixed and adaptive KL coefficients). Imports torch and
``mmgrpo.errors`` only: nothing here knows about models, environments or the loop.
"""
