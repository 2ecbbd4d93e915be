"""Rewards: rule scorers by data source (``rules``), a reward model (``model``), a reward server
(``http``), and ``scoring``, which turns any of them into the batch's token-level scores and verl's
reward metrics.
"""
