"""The training loop and its services: ``trainer`` (collect -> score -> advantages -> update, and the loop),
``builders`` (policy, env factory, rewards, optimizer from a config), ``dynamic`` (dynamic sampling),
``microbatch`` (micro-batched updates), ``faults``, ``checkpoint``, ``diagnostics``, ``distributed``,
``warmstart`` / ``warm_check`` / ``sft`` (supervised steps before GRPO) and ``plots``.
"""
