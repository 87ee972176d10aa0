"""Generative judges: an LLM served beside the policy that scores its responses
(``reward.judge``).

:mod:`.client` holds the judge's client and the plug-in registries (scorers, parsers);
:mod:`.scorers` the built-in ways to score; :mod:`.stage` the judge stage the reward stage
runs; :mod:`.tiny_judge` the tiny judge of the quickstart's task (``tiny-judge:<seed>``).
"""
